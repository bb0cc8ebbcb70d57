"""Attention computed by NumPy on the host: the CPU path's float32 passes (verify blocks, trees, decode steps).

On MLX's CPU backend the softmax of a short pass over a long cache is what each further verified row costs: per
layer and row, `heads x cached tokens` scores go through a mask, a max, an exponent and a sum, each a separate
single-threaded loop (MLX's own `exp` ~11 ns an element; the fused polynomial of `attention.shifted_exp` ~3 ns).
NumPy computes `exp` with SIMD code (under 0.5 ns an element here) and works in place, so once the pass's query,
keys and values are evaluated the whole attention runs faster on the host: scores and weighted values through
NumPy's BLAS, the mask applied where it bites (a causal block masks only its own last columns), max, `exp` and
sum in place. At 8.8k cached tokens this halves what a verified row costs (docs/cpu-performance.md).

The price is one evaluation per layer (MLX cannot run NumPy inside its graph), which on the CPU backend costs far
less than it saves. Inside a function transformation (`mx.compile`, `mx.vmap`), where nothing may be evaluated,
`attention` returns None and the caller computes in MLX instead. The result is a constant to MLX: this path is for
inference passes, never for a loss differentiated through the target (nothing in the engine does that).

Same semantics as `attention.attention`: queries [B, H, L, D], keys and values [B, KV, K, D] (H a multiple of KV),
the mask None, "causal" (bottom-right: the rows are the last L positions) or an array broadcastable to
[B, H, L, K], boolean (True sees) or added to the scores; a row that sees nothing gives NaN, as MLX's softmax does.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx
import numpy as np


def _grouped(mask: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """A mask broadcastable to [B, H, L, K] as one broadcastable to the grouped scores [B, KV, H / KV, L, K]."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Union[None, str, mx.array]) -> Optional[mx.array]:
    """softmax(scale * q k^T + mask) v in float32 on the host (see the module docstring); None inside a function
    transformation, where the caller must compute it in MLX."""
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, mx.float32):
        mask = mask.astype(mx.float32)  # NumPy has no bfloat16
    arrays = [queries, keys, values] + ([mask] if isinstance(mask, mx.array) else [])
    try:
        mx.eval(*arrays)
    except ValueError:  # mx.compile / mx.vmap: nothing may be evaluated here
        return None
    b, heads, rows, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # Each KV head's query heads as one block of rows: one matmul per KV head, no repeated keys. The keys and values
    # are views of the cache's buffer (no copy).
    q = np.asarray(queries).reshape(b, kv_heads, group * rows, dim) * np.float32(scale)
    scores = np.matmul(q, np.asarray(keys).swapaxes(-1, -2))  # [B, KV, G*L, K], a fresh array we may overwrite
    grouped = scores.reshape(b, kv_heads, group, rows, length)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention: unknown mask {mask!r}")
        first = max(length - rows, 0)  # row i sits at key position first + i: only the last columns are hidden
        hidden = np.arange(first, first + rows)[:, None] < np.arange(first, length)[None]
        np.copyto(grouped[..., first:], -np.inf, where=hidden)
    elif mask is not None:
        host = _grouped(np.asarray(mask), heads, kv_heads)
        if host.dtype == np.bool_:
            np.copyto(grouped, -np.inf, where=~host)
        else:
            grouped += host.astype(np.float32, copy=False)
    with np.errstate(invalid="ignore"):  # a row that sees nothing: -inf - -inf, NaN as in MLX
        scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    # Normalised after the weighted sum: [rows, D] divisions instead of [rows, K] (rounding differs, no more).
    out = np.matmul(scores, np.asarray(values))
    out /= total
    return mx.array(out.reshape(b, heads, rows, dim))
