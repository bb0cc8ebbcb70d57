"""MTP layers in the DeepSeek-V3 layout (deepseek_v3 / kimi_k25 targets), with the `MTPDrafter` interface.

DeepSeek-V3 style checkpoints (`num_nextn_predict_layers` >= 1) store each MTP layer as one more decoder layer
after the last: `model.layers.{num_hidden_layers}.*`. mlx-lm's loader drops it. The MTP at position t reads the
target's final-normed hidden state h_t and the embedding of token t+1, and predicts token t+2:

    x = eh_proj(concat[enorm(embed(tok_{t+1})), hnorm(h_t)])
    x = layer(x)             one full decoder layer (MLA attention, MoE or dense MLP: mlx-lm's own class)
    m_t = shared_head.norm(x)   logits = head(m_t); m_t also stands in for h_{t+1} in the next step

`embed` and `head` are the layer's own `embed_tokens` / `shared_head.head` where the checkpoint stores them (the
DeepSeek-V3 release does: copies of the target's), else the target's. With several nextn layers only the first
(`model.layers.{num_hidden_layers}`) is used, at every draft depth, as the reference implementation does. Pairing,
caching and the proposer are those of `mtp_block.MTPDrafter`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from .mtp_block import MTPConfig, MTPDrafter, _Borrowed
from .mtp_checkpoint import _load_weights, _no_mtp, _read, _shards

DEEPSEEK_FAMILIES = ("deepseek_v3", "kimi_k25")
# Where the nextn layer lives: plain DeepSeek-V3 checkpoints, and the nested multimodal layouts (Kimi K2.5).
_PREFIXES = ("model.layers.{}.", "language_model.model.layers.{}.", "model.language_model.layers.{}.")
# Tensors of the MTP layer itself; everything else under the prefix belongs to its decoder layer.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, vocab: int = 0):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if vocab:
            self.head = nn.Linear(hidden, vocab, bias=False)


class DeepseekMTPDrafter(MTPDrafter):
    """One DeepSeek-layout MTP layer; everything but the block itself is `MTPDrafter`'s."""

    def __init__(self, config: MTPConfig, args, own_embed: bool = False, own_head: bool = False):
        nn.Module.__init__(self)  # not MTPDrafter's: its fc / pre_fc norms are the Qwen layout's
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        self.config = config
        H, V, eps = config.hidden_size, config.vocab_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        # Its index is num_hidden_layers, so the MoE-or-dense choice follows the config as for any layer.
        self.layers = [DeepseekV3DecoderLayer(args, args.num_hidden_layers)]
        self.shared_head = _SharedHead(H, eps, V if own_head else 0)
        if own_embed:
            self.embed_tokens = nn.Embedding(V, H)
        self.target = _Borrowed()
        self.binding = None
        self.weights_form = "as stored"

    def forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> mx.array:
        """MTP outputs [1, T, H] for token ids [1, T] paired with hidden states [1, T, H] (already final-normed),
        appended to the cache at its next T positions."""
        embed = self.embed_tokens if "embed_tokens" in self else self.target.embed
        x = self.eh_proj(mx.concatenate([self.enorm(embed(tokens)), self.hnorm(hidden)], axis=-1))
        # MLA attention wants a boolean array (it masks its rope scores itself).
        mask = create_attention_mask(x, cache[0], return_array=True)
        x = self.layers[0](x, mask, cache[0])
        return self.shared_head.norm(x)

    def logits(self, m: mx.array) -> mx.array:
        return self.shared_head.head(m) if "head" in self.shared_head else self.target.head(m)


def _args(text: dict):
    from mlx_lm.models import deepseek_v3

    return deepseek_v3.ModelArgs.from_dict(text)


def sanitize_deepseek_mtp(weights: Dict[str, mx.array], args, prefix: str) -> Dict[str, mx.array]:
    """`<prefix>*` tensors -> this module's names. The decoder layer's tensors go through mlx-lm's own deepseek_v3
    conversion (fp8 / int4 dequantization, experts stacked into `switch_mlp`, `kv_b_proj` split into `embed_q` /
    `unembed_out`), posing as layer 0 of a one-layer model; MLX-layout tensors pass through unchanged."""
    from mlx_lm.models.deepseek_v3 import Model

    as_layer0 = {"model.layers.0." + k[len(prefix):]: v for k, v in weights.items()}
    converted = Model.sanitize(SimpleNamespace(args=replace(args, num_hidden_layers=1)), as_layer0)
    out = {}
    for key, value in converted.items():
        key = key[len("model.layers.0."):]
        if "rotary_emb" in key:
            continue
        out[key if key.startswith(_OWN) else "layers.0." + key] = value
    return out


def load_deepseek_mtp(folder: Path, config: dict, model_path, block_size: int) -> DeepseekMTPDrafter:
    """The first nextn layer of a DeepSeek-layout checkpoint folder (see `mtp.load_mtp_drafter`)."""
    text = dict(config.get("text_config") or config)
    n = int(text["num_hidden_layers"])
    depth = int(text.get("num_nextn_predict_layers") or 0)
    where = f"model.layers.{n}.* tensors"
    shards = _shards(folder)
    prefixes = tuple(p.format(n) for p in _PREFIXES)
    wanted = {name: [k for k in keys if k.startswith(prefixes)] for name, keys in shards.items()}
    wanted = {name: keys for name, keys in wanted.items() if keys}
    if not wanted or depth < 1:
        raise _no_mtp(f"target '{model_path}'", where)
    raw: Dict[str, mx.array] = {}
    for name, keys in wanted.items():
        raw.update(_read(folder / name, keys))
    prefix = next(p for p in prefixes if any(k.startswith(p) for k in raw))
    raw = {k: v for k, v in raw.items() if k.startswith(prefix)}
    args = _args(text)
    weights = sanitize_deepseek_mtp(raw, args, prefix)
    mtp = MTPConfig(config.get("model_type"), int(text["hidden_size"]), int(text["vocab_size"]), n, 1,
                    int(block_size))
    drafter = DeepseekMTPDrafter(mtp, args, own_embed="embed_tokens.weight" in weights,
                                 own_head="shared_head.head.weight" in weights)
    _load_weights(drafter, weights, config.get("quantization") or text.get("quantization")
                  or config.get("quantization_config"),
                  f"target '{model_path}': its {where} do not fit a DeepSeek-V3 MTP layer")
    return drafter
