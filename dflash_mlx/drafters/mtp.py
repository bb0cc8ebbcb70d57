"""The target's own multi-token-prediction (MTP) layers as a drafter (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next).

Qwen3.5 and Qwen3-Next checkpoints ship `mtp.*` tensors that mlx-lm's loader drops. The MTP at position t reads
the target's final-normed hidden state h_t and the embedding of token t+1, and predicts token t+2:

    x = fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
    x = layers(x)            mtp_num_hidden_layers full-attention decoder layers (mlx-lm's own layer classes)
    m_t = norm(x)            logits = target head(m_t); m_t also stands in for h_{t+1} in the next step

The embedding and LM head are the target's (borrowed through `bind`); the layers keep their own KV cache, one
entry per position. The tap is the target's last decoder layer (pre-norm); the drafter applies the target's own
final norm, as the MTP was trained on (and the reference feeds) the normed hidden state.

The draft cache (`make_cache`) is the layers' KV caches followed by one `MTPPending`: target hidden rows whose
next token is not known yet, and tokens waiting for their row. Row i of the target's hidden stream pairs with
token i+1 of the token stream, so the prefill only appends rows (`append_context`) and the proposer appends tokens
(`add_tokens`); pairs run through the MTP as soon as both halves are known (`run_ready`).

DeepSeek-V3 / Kimi K2.5 checkpoints store their MTP layer in another layout (`model.layers.{N}.*`): `mtp_deepseek`
builds that block on this class and `load_mtp_drafter` dispatches to it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Zero-centred (1 + w) RMSNorms of the MTP block, as the reference lists them (HF layout stores w).
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


@dataclass
class MTPConfig:
    """What the engine reads of a drafter's config, for the MTP block of a target with `num_target_layers`."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int = 1  # MTP layers
    block_size: int = 3  # widest pass: block_size - 1 drafts (the reference's default: depth + 2)
    mask_token_id: Optional[int] = None  # the MTP drafts autoregressively: no mask token
    needs_mask = False  # (class attribute) what the pairing check reads
    target_layer_ids: List[int] = field(default_factory=list)

    def __post_init__(self):
        self.target_layer_ids = [self.num_target_layers - 1]  # the last decoder layer (the drafter norms it)


@dataclass
class MTPPending:
    """The MTP's carry-over inside the draft cache (see the module docstring). `skip` tokens at the start of the
    token stream have no row (the very first prompt token); `seed` is the MTP output of the newest pair run."""

    hidden: Optional[mx.array] = None  # [1, P, H] target hidden rows (last layer, pre-norm) without their token
    tokens: List[int] = field(default_factory=list)
    skip: int = 1
    seed: Optional[mx.array] = None  # [1, 1, H]

    @property
    def rows(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.shape[1])

    @property
    def state(self) -> List[mx.array]:
        return [a for a in (self.hidden, self.seed) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def copy(self) -> "MTPPending":
        return MTPPending(self.hidden, list(self.tokens), self.skip, self.seed)  # arrays are never written in place

    def is_trimmable(self) -> bool:
        return False  # a prefix snapshot of it cannot be cut shorter

    def empty(self) -> bool:
        return self.hidden is None and not self.tokens and self.seed is None


class _Borrowed:
    """The target's embedding, LM head and final norm (a plain object, so none of it becomes our parameter)."""

    def __init__(self, embed=None, head=None, norm=None):
        self.embed, self.head, self.norm = embed, head, norm


class MTPDrafter(nn.Module):
    """The MTP block with the Drafter shape the engine expects; its drafts come from `decode.proposers.mtp`
    (`drafts_with` names that proposer)."""

    drafts_with = "mtp"

    def __init__(self, config: MTPConfig, layer_class, layer_args):
        super().__init__()
        self.config = config
        H, eps = config.hidden_size, layer_args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [layer_class(layer_args, 0) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.target = _Borrowed()
        self.binding = None
        self.weights_form = "as stored"

    # -- the Drafter shape ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> Optional[int]:
        return None

    def bind(self, binding) -> "MTPDrafter":
        """Borrow the target's embedding and head (a `TargetBinding`); the final norm from its source target."""
        self.binding = binding
        norm = getattr(getattr(getattr(binding, "source", None), "inner", None), "norm", None)
        self.target = _Borrowed(binding.embed, binding.head, self.target.norm if norm is None else norm)
        return self

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers] + [MTPPending()]

    def append_context(self, target_hidden: mx.array, cache: List[Any]) -> None:
        """Hidden rows [1, S, H] of newly processed target positions (the prefill); the pairs whose token is known
        run now, chunk by chunk (the proposer observes the prompt before the prefill)."""
        self.add_rows(cache, target_hidden)
        self.run_ready(cache)

    def add_rows(self, cache: List[Any], target_hidden: mx.array) -> None:
        """Hidden rows [1, S, H] (the tapped last layer, pre-norm) waiting for their tokens; nothing runs."""
        pending = cache[-1]
        pending.hidden = target_hidden if pending.hidden is None else mx.concatenate(
            [pending.hidden, target_hidden], axis=1)

    def add_tokens(self, cache: List[Any], tokens) -> None:
        """Tokens the target committed (or was prompted with), in order: each is the partner of one row."""
        pending = cache[-1]
        tokens = [int(t) for t in tokens]
        drop = min(pending.skip, len(tokens))
        pending.skip -= drop
        pending.tokens.extend(tokens[drop:])

    def rollback(self, cache: List[Any], num_tokens: int) -> None:
        """Drop the newest `num_tokens` MTP positions."""
        if num_tokens > 0:
            for c in cache[:-1]:
                c.trim(num_tokens)

    # -- the MTP itself ----------------------------------------------------------------------------------------
    def forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> mx.array:
        """MTP outputs [1, T, H] for token ids [1, T] paired with hidden states [1, T, H] (already final-normed),
        appended to the cache at its next T positions."""
        e = self.target.embed(tokens)
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0]) if self.layers else None
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)

    def logits(self, m: mx.array) -> mx.array:
        return self.target.head(m)

    def run_ready(self, cache: List[Any]) -> None:
        """Run every (row, token) pair whose token is known; the newest output becomes the seed."""
        pending = cache[-1]
        n = min(pending.rows, len(pending.tokens))
        if n == 0:
            return
        if self.target.embed is None or self.target.norm is None:
            raise RuntimeError("MTP drafter is not bound to a target; call drafter.bind(...) first")
        rows = pending.hidden[:, :n]
        ids = mx.array([pending.tokens[:n]], dtype=mx.int32)
        out = self.forward(ids, self.target.norm(rows), cache)
        pending.seed = out[:, -1:]
        pending.hidden = pending.hidden[:, n:] if pending.rows > n else None
        pending.tokens = pending.tokens[n:]

    def drop_newest(self, cache: List[Any], n: int) -> None:
        """Take back the newest `n` rows and tokens (not run yet): an observed pass undone."""
        pending = cache[-1]
        pending.hidden = pending.hidden[:, :-n] if pending.rows > n else None
        pending.tokens = pending.tokens[:-n] if n else pending.tokens

    def drop_pairs(self, cache: List[Any], n: int) -> None:
        """Forget the oldest `n` waiting (row, token) pairs: the MTP already holds entries for their positions."""
        pending = cache[-1]
        pending.hidden = pending.hidden[:, n:] if pending.rows > n else None
        pending.tokens = pending.tokens[n:]


# -- loading ---------------------------------------------------------------------------------------------------
def _no_mtp(where: str, tensors: str = "mtp.* tensors") -> DFlashError:
    return DFlashError(f"{where} has no MTP layers ({tensors}); use a DFlash drafter or 'lookup' (--draft lookup)")


def _header(path: Path) -> Dict[str, Any]:
    """A safetensors file's header (names, dtypes, shapes), read without its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _shards(folder: Path) -> Dict[str, List[str]]:
    """Tensor names per weights file: from the sharded index when there is one, else from each file's header."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        by_file: Dict[str, List[str]] = {}
        for key, name in json.loads(index.read_text()).get("weight_map", {}).items():
            by_file.setdefault(name, []).append(key)
        return by_file
    return {p.name: [k for k in _header(p) if k != "__metadata__"] for p in sorted(folder.glob("*.safetensors"))}


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


def _read(path: Path, keys: List[str]) -> Dict[str, mx.array]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="mlx") as f:
            return {k: mx.array(f.get_tensor(k)) for k in keys}
    except (ImportError, AttributeError, RuntimeError, TypeError):
        every = mx.load(str(path))
        return {k: every[k] for k in keys}


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


def _quantize(drafter: nn.Module, weights: Dict[str, mx.array], quantization: Optional[dict]) -> None:
    """Quantize the modules stored quantized (`<path>.scales`), with bits and group size read off their shapes."""
    mode = (quantization or {}).get("mode", "affine")
    stored = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}

    def predicate(path: str, module: nn.Module):
        if path not in stored or not hasattr(module, "to_quantized"):
            return False
        columns = module.weight.shape[-1]  # in-features of the float module
        packed, groups = weights[f"{path}.weight"].shape[-1], weights[f"{path}.scales"].shape[-1]
        return {"group_size": columns // groups, "bits": packed * 32 // columns, "mode": mode}

    if stored:
        nn.quantize(drafter, class_predicate=predicate)


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


def _load_weights(drafter: nn.Module, weights: Dict[str, mx.array], quantization: Optional[dict],
                  misfit: str) -> None:
    """Quantize what was stored quantized, load every tensor strictly; a misfit is one line (`misfit: why`)."""
    _quantize(drafter, weights, quantization)
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"{misfit}: {str(e).splitlines()[0]}") from e
    mx.eval(drafter.parameters())


def _with_norm(drafter: MTPDrafter, target_model) -> MTPDrafter:
    if target_model is not None:
        drafter.target.norm = _final_norm(target_model)
    return drafter
