"""Gemma 4 targets: the hooks `walk.walk` calls for per-layer inputs and KV sharing, and the scaled embedding.

Gemma 4 threads state between layers that other families do not: per-layer input embeddings, and the last
`num_kv_shared_layers` layers reusing the keys/values (and RoPE offset) of the last earlier layer of their type,
with no cache of their own. These hooks mirror `Gemma4TextModel.__call__`, reusing its helpers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from .mlx_lm_contract import gemma4_per_layer_inputs


def gemma4_embed(lm: nn.Module, inner: nn.Module, ids: mx.array) -> mx.array:
    return inner.embed_tokens(ids) * inner.embed_scale


def gemma4_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    """One mask per layer type (full, sliding), each from the first cache of that type."""
    by_type: Dict[str, Any] = {}
    masks = []
    for layer, c in zip(inner.layers, cache):
        if layer.layer_type not in by_type:
            window = inner.window_size if layer.layer_type == "sliding_attention" else None
            by_type[layer.layer_type] = create_attention_mask(h, c, window_size=window)
        masks.append(by_type[layer.layer_type])
    return masks


def gemma4_layer_inputs(inner: nn.Module, ids: mx.array, h: mx.array) -> Optional[List[mx.array]]:
    """The per-layer input embeddings [B, T, D] of every layer (per token), or None where the model has none."""
    if not inner.hidden_size_per_layer_input:
        return None
    inputs = gemma4_per_layer_inputs(inner, ids, h)
    return [inputs[:, :, i, :] for i in range(len(inner.layers))]


def gemma4_call(inner: nn.Module, layer: nn.Module, i: int, h: mx.array, mask: Any, cache: Any,
                state: Dict[str, Any]) -> mx.array:
    """Layer i of one segment: a KV-shared layer (no cache of its own) takes the keys, values and RoPE offset its
    source layer left in `state`; the per-layer input, when the model has them, is `state["input"]`."""
    shared = state.setdefault("shared", {})
    kvs, offset = shared.get(inner.previous_kvs[i], (None, None))
    per_layer = state.get("input")
    if per_layer is not None:
        per_layer = per_layer.reshape(h.shape[0], h.shape[1], -1)  # a tree's nodes: [n+1, 1, D]
    h, kvs, offset = layer(h, mask, cache, per_layer_input=per_layer, shared_kv=kvs, offset=offset)
    shared[i] = (kvs, offset)
    return h
