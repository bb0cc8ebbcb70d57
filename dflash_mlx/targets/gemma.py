"""Gemma 4 targets: the layer walk with per-layer inputs and KV sharing, and the scaled embedding.

Gemma 4 threads state between layers that the generic walk does not: per-layer input embeddings, and the last
`num_kv_shared_layers` layers reusing the keys/values (and RoPE offset) of the last earlier layer of their type,
with no cache of their own. This walk mirrors `Gemma4TextModel.__call__`, reusing its helpers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask


def gemma4_embed(lm: nn.Module, inner: nn.Module, ids: mx.array) -> mx.array:
    return inner.embed_tokens(ids) * inner.embed_scale


def _masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    by_type: Dict[str, Any] = {}
    masks = []
    for layer, c in zip(inner.layers, cache):
        if layer.layer_type not in by_type:
            window = inner.window_size if layer.layer_type == "sliding_attention" else None
            by_type[layer.layer_type] = create_attention_mask(h, c, window_size=window)
        masks.append(by_type[layer.layer_type])
    return masks


def gemma4_forward(family, lm: nn.Module, inner: nn.Module, ids: mx.array, cache: Optional[List[Any]],
                   taps: set) -> Tuple[mx.array, Dict[int, mx.array]]:
    n = len(inner.layers)
    embeddings = inner.embed_tokens(ids)
    h = embeddings * inner.embed_scale
    per_layer: List[Optional[mx.array]] = [None] * n
    if inner.hidden_size_per_layer_input:
        inputs = inner._get_per_layer_inputs(ids, embeddings)
        inputs = inner._project_per_layer_inputs(h, inputs)
        per_layer = [inputs[:, :, i, :] for i in range(n)]
    # KV-shared layers have no cache entry of their own.
    cache = [None] * n if cache is None else list(cache) + [None] * (n - len(cache))
    masks = _masks(inner, h, cache)
    shared: List[Tuple[Any, Any]] = [(None, None)] * n
    kept = {}
    for i, (layer, c, mask) in enumerate(zip(inner.layers, cache, masks)):
        kvs, offset = shared[inner.previous_kvs[i]]
        h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
        shared[i] = (kvs, offset)
        if i in taps:
            kept[i] = h
    return h, kept
