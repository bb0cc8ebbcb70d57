"""Scaled dot-product attention for the passes the layer walk restates: MLX's own, except on MLX's CPU backend.

On a GPU, `mx.fast.scaled_dot_product_attention` is one fused kernel and a verified row costs little. On MLX's CPU
backend the same call runs as separate ops (scores, softmax, weighted values), and the softmax's `exp` runs at
about 11 ns an element: at 8.8k cached tokens that exponent is most of what each further verified row costs (the
`benchmarks/row_cost.py` figures in docs/cpu-performance.md). `attention` therefore computes, on the CPU and for
passes of up to `MAX_ROWS` query rows (verify blocks and decode steps; prefill chunks keep MLX's), the same
attention with the exponent as a Cody-Waite reduction and a degree-7 polynomial that `mx.compile` fuses into one
elementwise kernel: about 3x cheaper than MLX's `exp`, within a few float32 ulps of it, and exactly 0 for masked
scores. Everything else is MLX's fallback restated (scale, grouped-query heads, the bottom-right causal mask, the
softmax in float32): a verify pass differs from MLX's own attention by rounding only, as a batch of rows already
differs from one row. Float32 passes over a long cache go further: once evaluated they attend on the host
through NumPy (`host_attention`: SIMD `exp`, the softmax in place), which halves a verified row's cost again; the
fused exponent remains for short caches (where the host path saves nothing), half precision (NumPy has no
bfloat16) and inside `mx.compile`. A quantized KV cache, attention sinks and any other device go to mlx-lm's call.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Set, Tuple, Union

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from . import host_attention

# Query rows up to which the CPU path runs (a verify block, a tree, a decode step); longer chunks are prefill,
# where the scores matrix is large and MLX's own call is kept.
MAX_ROWS = 64
# Whether the CPU path is used at all (benchmarks/row_cost.py turns it off to show MLX's own figures).
ENABLED = True
# Whether its float32 passes attend on the host through NumPy (`host_attention`); else all run the fused exponent.
HOST = True
# A server prepares its target on one thread and decodes on another, and a trace holds the streams it ran on: each
# thread keeps its own fused kernel.
_per_thread = threading.local()

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * _LN2_HI is exact (Cody-Waite)
# exp(r) = 1 + r + r^2 * P(r) on |r| <= ln2 / 2 (Cephes expf): relative error ~1e-7.
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def shifted_exp(scores: mx.array, shift: mx.array) -> mx.array:
    """exp(scores - shift) in float32 for scores <= shift (a softmax's numerators); 0 below -87.6 (where float32's
    exp is subnormal) and for -inf, so a masked score weighs exactly nothing."""
    x = mx.maximum(scores.astype(mx.float32) - shift, -88.0)
    n = mx.maximum(mx.floor(x * _LOG2E + 0.5), -127.0)  # 2^-127 has exponent bits 0: the result is 0
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _P[0]
    for c in _P[1:]:
        p = p * r + c
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    return (p * r * r + r + 1.0) * two_n


class _Fused:
    """`shifted_exp` compiled into one kernel. `mx.compile` keeps a trace per input shape and a verify pass at a
    growing context has a new one every step, so the compiled function is made anew after `MAX_SHAPES` shapes
    (dropping it frees its traces)."""

    MAX_SHAPES = 64

    def __init__(self) -> None:
        self._fn: Optional[Callable] = None
        self._shapes: Set[Tuple] = set()

    def __call__(self, scores: mx.array, shift: mx.array) -> mx.array:
        key = (scores.shape, scores.dtype, shift.shape)
        if self._fn is None or (key not in self._shapes and len(self._shapes) >= self.MAX_SHAPES):
            self._fn = mx.compile(lambda s, m: shifted_exp(s, m))  # a new function: a cache of its own
            self._shapes = set()
        self._shapes.add(key)
        return self._fn(scores, shift)


def fused_exp(scores: mx.array, shift: mx.array) -> mx.array:
    """`shifted_exp` as one fused kernel (this thread's `_Fused`)."""
    fused = getattr(_per_thread, "fused", None)
    if fused is None:
        fused = _per_thread.fused = _Fused()
    return fused(scores, shift)


def on_cpu_path(rows: int) -> bool:
    """Whether a pass of `rows` query rows gets the CPU path (MLX's CPU backend, a short pass)."""
    return ENABLED and rows <= MAX_ROWS and mx.default_device() == mx.cpu


def uses_own(queries: mx.array, cache: Any = None, sinks: Optional[mx.array] = None) -> bool:
    """Whether `attention` computes this call itself (the CPU path) rather than handing it to mlx-lm: a quantized
    KV cache and attention sinks stay with mlx-lm's call."""
    return on_cpu_path(queries.shape[2]) and sinks is None and not hasattr(cache, "bits")


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
              mask: Union[None, str, mx.array], sinks: Optional[mx.array] = None) -> mx.array:
    """softmax(scale * q k^T + mask) v for queries [B, H, L, D] and keys, values [B, KV, K, D] (H a multiple of
    KV), as mlx-lm's `scaled_dot_product_attention` takes them; the mask None, "causal" or an array (boolean: True
    sees; else added to the scores)."""
    if not uses_own(queries, cache, sinks):
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if (HOST and queries.dtype == keys.dtype == values.dtype == mx.float32
            and keys.shape[2] - queries.shape[2] >= host_attention.MIN_CACHE):
        out = host_attention.attention(queries, keys, values, scale, mask)
        if out is not None:  # (None: inside mx.compile / mx.vmap)
            return out
    b, heads, rows, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # Each KV head's query heads as one block of rows: one matmul per KV head, no repeated keys.
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(b, kv_heads, group * rows, dim)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, kv_heads, group, rows, length)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention: unknown mask {mask!r}")
        first = max(length - rows, 0)  # the rows are the last ones: row i sits at key position first + i
        seen = mx.arange(first, first + rows)[:, None] >= mx.arange(length)[None]
        scores = mx.where(seen, scores, -mx.inf)
    elif mask is not None:
        grouped = host_attention.grouped_mask(mask, heads, kv_heads)
        scores = mx.where(grouped, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + grouped
    top = mx.max(scores, axis=-1, keepdims=True).astype(mx.float32)
    weights = fused_exp(scores, top)  # float32, as MLX's precise softmax
    total = mx.sum(weights, axis=-1).reshape(b, kv_heads, group * rows, 1)
    # Normalised after the weighted sum: [rows, D] divisions instead of [rows, K] (rounding differs, no more).
    out = weights.astype(values.dtype).reshape(b, kv_heads, group * rows, length) @ values
    return (out.astype(mx.float32) / total).astype(values.dtype).reshape(b, heads, rows, dim)


def warm_up(target) -> None:
    """Run the CPU path once on tiny inputs shaped like `target`'s attention (a decode step, a causal block, a
    tree's boolean mask), so that MLX builds its fused kernels now: the first build of each runs a C++ compiler for
    under a second (MLX keeps them on disk after), which would otherwise land in a timed pass and skew the
    planner's measured cost of that width."""
    if not on_cpu_path(2):
        return
    seen = set()
    for layer in getattr(target.inner, "layers", ()):  # every layer's head shapes (a pipeline stage's included)
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "q_proj")):
            continue
        proj = attn.q_proj
        dtype = getattr(proj, "scales", proj.weight).dtype  # a quantized projection's activations: its scales'
        dim = proj.weight.shape[0] // attn.n_heads  # [heads * head_dim, ...], quantized or not
        key = (attn.n_heads, attn.n_kv_heads, dim, dtype)
        if key in seen:
            continue
        seen.add(key)
        kv = mx.zeros((1, attn.n_kv_heads, 5, dim), dtype=dtype)
        for rows, mask in ((1, None), (3, "causal"), (3, mx.ones((1, 1, 3, 5), dtype=mx.bool_))):
            mx.eval(attention(mx.zeros((1, attn.n_heads, rows, dim), dtype=dtype), kv, kv, None, 1.0, mask))
