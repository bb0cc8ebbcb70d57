"""One target pass over several requests' blocks of different widths (ragged), each with its own caches.

Decoding a small model is memory-bound: the weights read per pass dominate, and almost all of them sit in the
position-independent parts of the network (embedding, norms, MLP, LM head). So the blocks of all requests are laid
end to end as one token stream [1, N, H] for those parts, and only the token mixer of each layer (attention, or a
hybrid's GatedDeltaNet) runs per request, on that request's slice with that request's own cache and mask, exactly
as its pass alone would. No padding, so widths can differ freely; every cache holds what it would hold alone, and
rolls back per request as usual (`TargetModel.rollback`).

Layers are split only where their call is known to be the pre-norm block `h = x + mix(norm1(x)); h + mlp(norm2(h))`
(mlx-lm's llama, qwen2, qwen3, qwen3_moe, qwen3_5 and qwen3_next layers); any other layer runs whole per request,
and a family with its own walk (Gemma 4) runs whole passes per request. Within the mixer, the plain attention of
llama, qwen2, qwen3 and qwen3_moe (projections, optional q/k norms, RoPE at the cache's offset, cache update, SDPA)
runs its four projections on the whole stream too, and only RoPE, the cache update and SDPA per request: the
projections are a tenth of the weights, read once per pass instead of once per request. Either way the result is
that of `TargetModel.__call__` on each block, up to the rounding of matmuls over more rows.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from .adapter import TargetModel
from .families import walk_layers
from .hybrid import gated_delta_net

# mlx-lm model modules whose decoder layers are exactly the pre-norm block above (checked by tests/test_batching.py).
_PRE_NORM_MODULES = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"}
# mlx-lm modules whose `Attention.__call__` is the plain one `_shared_attention` restates (tests/test_batching.py).
_PLAIN_ATTENTION_MODULES = {"llama", "qwen2", "qwen3", "qwen3_moe"}


def splittable(layer: nn.Module) -> bool:
    """Whether `layer` is a pre-norm block whose token mixer can run per request and the rest on all tokens."""
    module = type(layer).__module__.rsplit(".", 1)[-1]
    mixer = "linear_attn" if getattr(layer, "is_linear", False) else "self_attn"
    return (module in _PRE_NORM_MODULES and mixer in layer and "mlp" in layer
            and "input_layernorm" in layer and "post_attention_layernorm" in layer)


def plain_attention(attn: nn.Module) -> bool:
    """Whether `attn` is mlx-lm's plain `Attention` of a module whose call `_shared_attention` restates."""
    module = type(attn).__module__.rsplit(".", 1)[-1]
    return (type(attn).__name__ == "Attention" and module in _PLAIN_ATTENTION_MODULES
            and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads",
                                                "n_kv_heads", "scale")))


def _shared_attention(attn: nn.Module, x: mx.array, spans: Sequence[Tuple[int, int]], masks: Sequence[Any],
                      caches: Sequence[Any]) -> mx.array:
    """mlx-lm's plain attention over every request's slice of `x` [1, N, H]: the projections on all N tokens at
    once, RoPE at each request's own cache offset, its cache update and SDPA per request (with a cache always)."""
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    outs = []
    for (a, b), mask, cache in zip(spans, masks, caches):
        n = b - a
        queries = q[:, a:b].reshape(1, n, attn.n_heads, -1)
        keys = k[:, a:b].reshape(1, n, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # qwen3, qwen3_moe
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        values = v[:, a:b].reshape(1, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        outs.append(out.transpose(0, 2, 1, 3).reshape(1, n, -1))
    return attn.o_proj(mx.concatenate(outs, axis=1))


def _mix(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    """The layer's token mixer on one request's normed slice (the hybrid walk's recording GatedDeltaNet)."""
    if getattr(layer, "is_linear", False):
        return gated_delta_net(layer.linear_attn, x, mask, cache)
    return layer.self_attn(x, mask, cache)


def ragged_forward(target: TargetModel, blocks: Sequence[mx.array], caches: Sequence[List[Any]]
                   ) -> Tuple[List[mx.array], List[mx.array]]:
    """Logits [1, w_i, V] and tapped features [1, w_i, n*H] of each block [1, w_i], each through its own caches."""
    if target.family.forward is not walk_layers or len(blocks) == 1:
        # A walk of its own (Gemma 4's per-layer inputs and shared KV), or nothing to share: whole passes.
        outs = [target(b, c) for b, c in zip(blocks, caches)]
        return [o[0] for o in outs], [o[1] for o in outs]
    with target.verify_qmm:
        return _walk(target, blocks, caches)


def _walk(target: TargetModel, blocks: Sequence[mx.array], caches: Sequence[List[Any]]
          ) -> Tuple[List[mx.array], List[mx.array]]:
    target._check_whole()
    family, lm, inner = target.family, target.lm, target.inner
    widths = [b.shape[1] for b in blocks]
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
    spans = list(zip(bounds[:-1], bounds[1:]))
    h = family.embed(lm, inner, mx.concatenate(list(blocks), axis=1))

    def parts(x: mx.array) -> List[mx.array]:
        return [x[:, bounds[i]: bounds[i + 1]] for i in range(len(blocks))]

    # Each request's masks from its own slice and caches, as its pass alone builds them.
    masks = [family.layer_masks(inner, part, cache) for part, cache in zip(parts(h), caches)]
    taps = set(target.tap_layer_ids)
    kept = {}
    for i, layer in enumerate(inner.layers):
        if splittable(layer):
            normed = layer.input_layernorm(h)
            attn = getattr(layer, "self_attn", None)
            if not getattr(layer, "is_linear", False) and plain_attention(attn):
                h = h + _shared_attention(attn, normed, spans, [m[i] for m in masks], [c[i] for c in caches])
            else:
                h = h + mx.concatenate([_mix(layer, x, m[i], c[i]) for x, m, c in zip(parts(normed), masks, caches)],
                                       axis=1)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = mx.concatenate([family.call_layer(layer, x, m[i], c[i])
                                for x, m, c in zip(parts(h), masks, caches)], axis=1)
        if i in taps:
            kept[i] = h
    logits = target.head(inner.norm(h))
    feats = [kept[i] for i in target.tap_layer_ids]
    hidden = mx.concatenate(feats, axis=-1) if len(feats) > 1 else (feats[0] if feats else h[..., :0])
    return parts(logits), parts(hidden)
