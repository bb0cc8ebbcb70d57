"""The target's own multi-token-prediction (MTP) layers as a drafter (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next): loading
them from the target's checkpoint (`load_mtp_drafter`, for every layout).

Qwen3.5 and Qwen3-Next checkpoints ship `mtp.*` tensors that mlx-lm's loader drops; they load into the block of
`mtp_block.MTPDrafter` (what it computes and how its draft cache pairs rows with tokens: that module's docstring).
DeepSeek-V3 / Kimi K2.5 checkpoints store their MTP layer in another layout (`model.layers.{N}.*`): `mtp_deepseek`
builds that block and `load_mtp_drafter` dispatches to it. Reading the tensors is `mtp_checkpoint`'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..errors import DFlashError
from .mtp_block import MTPConfig, MTPDrafter
from .mtp_checkpoint import _header, _load_weights, _no_mtp, _read, _shards

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Zero-centred (1 + w) RMSNorms of the MTP block, as the reference lists them (HF layout stores w).
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


# -- loading ---------------------------------------------------------------------------------------------------
def _hf_layout(folder: Path, shards: Dict[str, List[str]], model_type: str) -> bool:
    """Whether the checkpoint is in the Hugging Face layout, decided as mlx-lm's sanitize decides it for the main
    norms: Qwen3-Next by its per-expert tensors, Qwen3.5 by a GatedDeltaNet conv1d weight not yet moved."""
    if model_type == "qwen3_next":
        return any(re.search(r"\.mlp\.experts\.0\.up_proj\.weight$", k) for keys in shards.values() for k in keys)
    for name, keys in shards.items():
        conv = next((k for k in keys if "conv1d.weight" in k and not k.startswith("mtp.")), None)
        if conv is not None:
            return _header(folder / name)[conv]["shape"][-1] != 1
    return False


def sanitize_mtp(weights: Dict[str, mx.array], hf_layout: bool) -> Dict[str, mx.array]:
    """`mtp.*` tensors -> this module's names: prefix dropped, (1 + w) norms shifted in the HF layout, experts
    stacked into mlx-lm's `switch_mlp` (fused `gate_up_proj` or per-expert tensors)."""
    out = {}
    for key, value in weights.items():
        key = key[len("mtp."):]
        if hf_layout and key.endswith(_SHIFTED_NORMS) and value.ndim == 1:
            value = value + 1.0
        out[key] = value
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate, up = mx.split(out.pop(key), 2, axis=-2)
        out[f"{prefix}.switch_mlp.gate_proj.weight"], out[f"{prefix}.switch_mlp.up_proj.weight"] = gate, up
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    groups: Dict[tuple, Dict[int, str]] = {}
    for key in out:
        m = re.fullmatch(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)", key)
        if m:
            groups.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = key
    for (prefix, proj, kind), keys in groups.items():
        out[f"{prefix}.switch_mlp.{proj}.{kind}"] = mx.stack([out.pop(keys[e]) for e in sorted(keys)])
    return out


def _layer(model_type: str, text: dict, num_layers: int):
    """mlx-lm's own decoder layer class and arguments for a full-attention MTP layer of this family."""
    overrides = dict(num_hidden_layers=num_layers, full_attention_interval=1)
    if model_type == "qwen3_next":
        from mlx_lm.models import qwen3_next

        # As the reference: every MTP layer is a sparse-MoE layer when the target has experts.
        args = qwen3_next.ModelArgs.from_dict(dict(text, **overrides, mlp_only_layers=[], decoder_sparse_step=1))
        return qwen3_next.Qwen3NextDecoderLayer, args
    from mlx_lm.models import qwen3_5

    return qwen3_5.DecoderLayer, qwen3_5.TextModelArgs.from_dict(dict(text, **overrides))


def _final_norm(target_model):
    inner = getattr(target_model, "inner", None)
    if inner is None:
        lm = getattr(target_model, "language_model", target_model)
        inner = getattr(lm, "model", None)
    return getattr(inner, "norm", None)


def load_mtp_drafter(model_path, target_model=None, block_size: int = 3,
                     revision: Optional[str] = None) -> MTPDrafter:
    """The MTP drafter stored in the target's checkpoint (a local folder or a hub repo id, as the target was
    loaded from): the Qwen layout (`mtp.*`) here, the DeepSeek-V3 one (`model.layers.{N}.*`) in `mtp_deepseek`.
    Reads only the weights files that hold MTP tensors. Raises DFlashError (one line) when the architecture or the
    checkpoint has no MTP layers."""
    folder = Path(str(model_path)).expanduser()
    if not folder.is_dir():
        from mlx_lm.utils import _download

        folder = _download(str(model_path), revision=revision)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read {folder / 'config.json'}: {e}") from e
    model_type = config.get("model_type")
    text = dict(config.get("text_config") or config)
    num_layers = int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)
    if model_type in ("deepseek_v3", "kimi_k25"):
        from .mtp_deepseek import load_deepseek_mtp

        return _with_norm(load_deepseek_mtp(folder, config, model_path, block_size), target_model)
    if model_type not in MTP_FAMILIES:
        raise _no_mtp(f"target '{model_path}' ({model_type})")
    shards = _shards(folder)
    wanted = {name: [k for k in keys if k.startswith("mtp.")] for name, keys in shards.items()}
    wanted = {name: keys for name, keys in wanted.items() if keys}
    if not wanted or num_layers < 1:
        raise _no_mtp(f"target '{model_path}'")
    raw: Dict[str, mx.array] = {}
    for name, keys in wanted.items():
        raw.update(_read(folder / name, keys))
    weights = sanitize_mtp(raw, _hf_layout(folder, shards, model_type))
    layer_class, layer_args = _layer(model_type, text, num_layers)
    mtp = MTPConfig(model_type, int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]),
                    num_layers, int(block_size))
    drafter = MTPDrafter(mtp, layer_class, layer_args)
    _load_weights(drafter, weights, config.get("quantization") or config.get("quantization_config"),
                  f"target '{model_path}': its mtp.* tensors do not fit a {model_type} MTP block")
    return _with_norm(drafter, target_model)


def _with_norm(drafter: MTPDrafter, target_model) -> MTPDrafter:
    if target_model is not None:
        drafter.target.norm = _final_norm(target_model)
    return drafter
