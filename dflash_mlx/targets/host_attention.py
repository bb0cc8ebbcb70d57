"""Attention computed by NumPy on the host: the CPU path's float32 passes (verify blocks, trees, decode steps).

On MLX's CPU backend the softmax of a short pass over a long cache is what each further verified row costs: per
layer and row, `heads x cached tokens` scores go through a mask, a max, an exponent and a sum, each a separate
single-threaded loop (MLX's own `exp` ~11 ns an element; the fused polynomial of `attention.shifted_exp` ~3 ns).
NumPy computes `exp` with SIMD code (under 0.5 ns an element here) and works in place, so once the pass's
queries, keys and values are evaluated the whole attention runs faster on the host. At 8.8k cached tokens this
halves what a verified row costs (docs/cpu-performance.md). The price is one evaluation per layer (MLX cannot run
NumPy inside its graph) and a copy of the result back: over a cache of fewer than `MIN_CACHE` tokens it saves
nothing, and `attention.attention` keeps MLX's fused ops there.

A row's result must not depend on the shape of the pass it is in: a verify pass of W rows that commits k tokens
must leave the cache a pass of those k tokens at the same offset would (rollback is exact). So the keys are taken
in two parts:
- the cache (every key before the pass's own): one BLAS product per KV head for the scores and one for the
  weighted values, with at least `MIN_ROWS` query rows (a short product is padded with copies of its first row:
  BLAS libraries sum a matrix-vector or few-row product in another order than a larger one);
- the pass's own keys, which the mask hides in part and whose count varies with the pass: scores, weights and
  sums computed element by element in a fixed order (a hidden key adds an exact 0 wherever it sits).
The softmax sums the cache part in one NumPy reduction (its length is the pass's offset, the same for any pass
at that offset) and adds the own part in order.

Inside a function transformation (`mx.compile`, `mx.vmap`), where nothing may be evaluated, `attention` returns
None and the caller computes in MLX. The result is a constant to MLX: this path is for inference passes, never for
a loss differentiated through the target (nothing in the engine does that).

Same semantics as `attention.attention`: queries [B, H, L, D], keys and values [B, KV, K, D] (H a multiple of KV,
the pass's own L keys last), the mask None, "causal" (bottom-right) or an array broadcastable to [B, H, L, K],
boolean (True sees) or added to the scores; a row that sees nothing gives NaN, as MLX's softmax does.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx
import numpy as np

# Cached tokens from which `attention.attention` hands float32 passes to this path: below it MLX's fused ops are
# as fast (one layer of 14 heads at 512 cached tokens: 0.20 ms fused, 0.34 ms here for a decode step; even at
# 1024; 2-3x faster here from 2048 on).
MIN_CACHE = 1024
# Query rows (heads x tokens of one KV head) below which the cache's products are padded: the BLAS NumPy ships
# sums products of fewer rows in another order (measured: up to 15 rows at some shapes, none from 16 on).
MIN_ROWS = 16


def grouped_mask(mask, heads: int, kv_heads: int):
    """A mask broadcastable to [B, H, L, K] as one broadcastable to the grouped scores [B, KV, H / KV, L, K] (an MLX
    or a NumPy array)."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])


def _apply(scores: np.ndarray, mask: Optional[np.ndarray]) -> None:
    """Hide (boolean False) or add (float) `mask` in place; scores [B, KV, G, L, K], mask broadcastable to it."""
    if mask is None:
        return
    if mask.dtype == np.bool_:
        np.copyto(scores, -np.inf, where=~mask)
    else:
        scores += mask


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Union[None, str, mx.array]) -> Optional[mx.array]:
    """softmax(scale * q k^T + mask) v in float32 on the host (see the module docstring); None inside a function
    transformation, where the caller must compute it in MLX."""
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"attention: unknown mask {mask!r}")
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, mx.float32):
        mask = mask.astype(mx.float32)  # NumPy has no bfloat16
    arrays = [queries, keys, values] + ([mask] if isinstance(mask, mx.array) else [])
    try:
        mx.eval(*arrays)
    except ValueError:  # mx.compile / mx.vmap: nothing may be evaluated here
        return None
    b, heads, rows, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group, past = heads // kv_heads, length - rows
    if past < 0:
        return None  # fewer keys than queries: not a pass over a cache (MLX's rules apply)
    # Each KV head's query heads as one block of rows: one product per KV head, no repeated keys. The keys and
    # values are views of the cache's buffer (no copy).
    q = np.asarray(queries).reshape(b, kv_heads, group, rows, dim) * np.float32(scale)
    k, v = np.asarray(keys)[:, :, None], np.asarray(values)[:, :, None]  # [B, KV, 1, K, D]
    host = None
    if isinstance(mask, mx.array):
        host = grouped_mask(np.asarray(mask), heads, kv_heads)
        host = np.broadcast_to(host, host.shape[:-1] + (length,))

    # The pass's own keys, element by element: [B, KV, G, L, L].
    own = (q[:, :, :, :, None, :] * k[:, :, :, None, past:, :]).sum(axis=-1)
    if isinstance(mask, str):  # "causal": a row sees its own key and those before it
        np.copyto(own, -np.inf, where=np.triu(np.ones((rows, rows), dtype=bool), 1))
    _apply(own, host[..., past:] if host is not None else None)
    top = own.max(axis=-1, keepdims=True)

    cache = None
    if past:
        flat = q.reshape(b, kv_heads, group * rows, dim)
        if flat.shape[2] < MIN_ROWS:
            flat = np.concatenate([flat, np.broadcast_to(flat[:, :, :1], (b, kv_heads, MIN_ROWS - flat.shape[2], dim))],
                                  axis=2)
        padded = np.matmul(flat, k[:, :, 0, :past].swapaxes(-1, -2))  # [B, KV, >= G*L, past]
        cache = padded[:, :, : group * rows].reshape(b, kv_heads, group, rows, past)
        _apply(cache, host[..., :past] if host is not None else None)
        with np.errstate(invalid="ignore"):
            top = np.maximum(top, cache.max(axis=-1, keepdims=True))

    with np.errstate(invalid="ignore"):  # a row that sees nothing: -inf - -inf, NaN as in MLX
        own -= top
    np.exp(own, out=own)
    total = np.zeros(own.shape[:-1] + (1,), dtype=np.float32)
    out = np.zeros(own.shape[:-1] + (dim,), dtype=np.float32)
    for j in range(rows):  # in order: a hidden key adds an exact 0
        total += own[..., j : j + 1]
        out += own[..., j : j + 1] * v[:, :, :, past + j : past + j + 1]
    if cache is not None:
        with np.errstate(invalid="ignore"):
            cache -= top
        np.exp(cache, out=cache)
        total = cache.sum(axis=-1, keepdims=True) + total
        weighted = np.matmul(padded, v[:, :, 0, :past])[:, :, : group * rows]
        out = weighted.reshape(b, kv_heads, group, rows, dim) + out
    out /= total
    return mx.array(out.reshape(b, heads, rows, dim))
