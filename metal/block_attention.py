"""Drafter block attention: B <= 16 block rows x GQA heads over [cached context K/V ; the block's own K/V].

`block_attention` is what `DraftAttention` calls. Masks (see `block_attention.metal` for the rule): block keys
are all visible, or causal in the block; a sliding layer sees context keys over absolute positions
(position > row position - window). The reference concatenates and masks as the drafter always did and calls
`mx.fast.scaled_dot_product_attention`; the kernel (`block_attention.metal`) reads the context in place (no
concat, no mask array), shares each K/V read among the GQA heads of a group, and splits long contexts into
chunks (partials, then a merge). On MLX's CPU backend a long float32 context is attended on the host through
NumPy instead (`block_attention_host`: MLX's CPU softmax runs its `exp` an element at a time).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from .kernel_file import kernels_on, load_kernel_file

ROWS_PER_SIMDGROUP = 4  # DFLASH_ATTN_ROWS in the source
# Up to 32 rows (GQA heads x block rows of one KV head) share a threadgroup and each read of a K/V element; a
# 4:1 group of 16 rows makes two threadgroups per chunk, adjacent in dispatch order, so the second read mostly
# hits the cache. 256 threads: safe for this kernel's register use on every Apple GPU.
MAX_SIMDGROUPS = 8
MAX_ROWS = 16
HEAD_DIMS = (64, 128, 256)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Keys per chunk. A chunk's partial (float32 acc, max, sum per row) is written and read back once; at 512 keys
# that is a quarter of the chunk's K/V bytes for 64 bf16 rows (2 * rows / chunk). Long contexts get up to 64
# chunks per KV head, enough threadgroups to fill a large GPU. Not yet tuned on Apple hardware.
MIN_CHUNK = 512
MAX_CHUNKS = 64
# Context keys from which MLX's CPU backend hands float32 block attention to the host (`block_attention_host`):
# below, the evaluation and the copy back cost what NumPy's faster softmax saves (as for the target's passes,
# dflash_mlx.targets.host_attention.MIN_CACHE).
HOST_MIN_CONTEXT = 1024


def sliding_window(window: Optional[int]) -> Optional[int]:
    """The one meaning of `window` for kernel and reference: a positive number of positions, or None for none.
    None, 0 and negative values all mean no window (the kernel's `window <= 0`)."""
    return window if window is not None and window > 0 else None


def block_attention_reference(q: mx.array, k: mx.array, v: mx.array, ctx_k: mx.array, ctx_v: mx.array, *,
                              scale: float, window: Optional[int] = None, causal: bool = False,
                              n_ctx: Optional[int] = None, sinks: Optional[mx.array] = None) -> mx.array:
    """Attention of the block rows; returns [1, Hq, B, D] like `mx.fast.scaled_dot_product_attention`.

    q [1, Hq, B, D] and k, v [1, Hkv, B, D] (the block, rotary already applied); ctx_k, ctx_v [1, Hkv, L, D] hold
    the context at positions 0..n_ctx-1 (n_ctx defaults to L); the block sits at positions n_ctx..n_ctx+B-1.
    `window` None, 0 or negative: no window (`sliding_window`). `sinks` [Hq]: a learned per-head logit added to
    each row's softmax denominator (an attention sink with no value; DSpark's Nemotron heads), as SDPA takes it.
    """
    B = q.shape[2]
    window = sliding_window(window)
    n_ctx = ctx_k.shape[2] if n_ctx is None else n_ctx
    first = max(n_ctx - (window - 1), 0) if window is not None else 0  # the oldest context key slot 0 can see
    ctx_k, ctx_v = ctx_k[:, :, first:n_ctx], ctx_v[:, :, first:n_ctx]
    keys = mx.concatenate([ctx_k, k], axis=2)
    values = mx.concatenate([ctx_v, v], axis=2)
    mask = None
    if window is not None or causal:
        n_seen = n_ctx - first
        slot = mx.arange(B)[:, None]
        col = mx.arange(n_seen + B)[None]
        # Context: slot i (position n_ctx+i) sees positions above n_ctx+i-W; block: all slots or j <= i.
        sees_ctx = col < n_seen
        if window is not None:
            sees_ctx = sees_ctx & (first + col > n_ctx + slot - window)
        sees_blk = (col >= n_seen) & ((col - n_seen <= slot) if causal else True)
        mask = sees_ctx | sees_blk
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import kernel  # the factory: mx.fast.metal_kernel on a Mac, the emulator in tests

    src = load_kernel_file("block_attention.metal")
    partial = kernel(
        name="dflash_block_attn_partial",
        input_names=["q", "blk_k", "blk_v", "ctx_k", "ctx_v", "n_ctx", "window", "causal", "chunk", "scale"],
        output_names=["part_o", "part_m", "part_l"],
        source=src.bodies["dflash_block_attn_partial"],
        header=src.header,
        ensure_row_contiguous=False,  # the context is read through its strides, never copied
    )
    merge = kernel(
        name="dflash_block_attn_merge",
        input_names=["part_o", "part_m", "part_l"],
        output_names=["out"],
        source=src.bodies["dflash_block_attn_merge"],
        header=src.header,
    )
    return partial, merge


def chunk_size(n_keys: int) -> int:
    """Keys per pass-1 chunk for `n_keys` keys (context seen + block)."""
    return max(MIN_CHUNK, -(-n_keys // MAX_CHUNKS))


def block_attention_metal(q: mx.array, k: mx.array, v: mx.array, ctx_k: mx.array, ctx_v: mx.array, *,
                          scale: float, window: Optional[int] = None, causal: bool = False,
                          n_ctx: Optional[int] = None, chunk: Optional[int] = None) -> mx.array:
    """The kernel; same arguments and result as `block_attention_reference` (`chunk` forces the split size)."""
    _, Hq, B, D = q.shape
    Hkv = k.shape[1]
    window = sliding_window(window)
    n_ctx = ctx_k.shape[2] if n_ctx is None else n_ctx
    first = max(n_ctx - (window - 1), 0) if window is not None else 0
    n_keys = n_ctx - first + B
    chunk = chunk or chunk_size(n_keys)
    n_chunks = -(-n_keys // chunk)
    rows = (Hq // Hkv) * B
    sgs = min(MAX_SIMDGROUPS, -(-rows // ROWS_PER_SIMDGROUP))
    row_groups = -(-rows // (sgs * ROWS_PER_SIMDGROUP))
    partial, merge = _kernels()
    part_o, part_m, part_l = partial(
        inputs=[mx.contiguous(q[0]), mx.contiguous(k[0]), mx.contiguous(v[0]), ctx_k, ctx_v, n_ctx,
                window or 0, int(causal), chunk, float(scale)],
        grid=(32 * sgs * row_groups, n_chunks, Hkv),
        threadgroup=(32 * sgs, 1, 1),
        output_shapes=[(n_chunks, Hq, B, D), (n_chunks, Hq, B), (n_chunks, Hq, B)],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = merge(
        inputs=[part_o, part_m, part_l],
        template=[("T", q.dtype)],
        grid=(D, Hq * B, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(1, B, Hq, D)],
        output_dtypes=[q.dtype],
    )
    return out.transpose(0, 2, 1, 3)  # [1, Hq, B, D]; the drafter's transpose back is free


def kernel_supports(q: mx.array, k: mx.array, ctx_k: mx.array) -> bool:
    """Shapes and dtypes the kernel handles (batch 1, B <= 16 rows, head_dim 64/128/256, float dtypes)."""
    return (
        q.ndim == 4 and q.shape[0] == 1 and 1 <= q.shape[2] <= MAX_ROWS and q.shape[3] in HEAD_DIMS
        and q.dtype in DTYPES and q.shape[1] % k.shape[1] == 0 and ctx_k.ndim == 4 and ctx_k.shape[0] == 1
    )


def host_supports(q: mx.array, k: mx.array, ctx_k: mx.array) -> bool:
    """Where `block_attention_host` pays: MLX's CPU backend, float32, a context of `HOST_MIN_CONTEXT` keys or more."""
    return (mx.default_device() == mx.cpu and q.dtype == k.dtype == ctx_k.dtype == mx.float32 and q.shape[0] == 1
            and ctx_k.shape[2] >= HOST_MIN_CONTEXT)


def block_attention_host(q: mx.array, k: mx.array, v: mx.array, ctx_k: mx.array, ctx_v: mx.array, *,
                         scale: float, window: Optional[int] = None, causal: bool = False,
                         n_ctx: Optional[int] = None, sinks: Optional[mx.array] = None) -> Optional[mx.array]:
    """The reference's attention in float32 on the host through NumPy (MLX's CPU backend: BLAS products, a SIMD
    `exp`, no concatenated copy of the context); None inside `mx.compile` / `mx.vmap` (nothing may be evaluated
    there). Only drafts depend on it, so no rounding rule binds it beyond the reference's tolerance."""
    try:
        mx.eval(q, k, v, ctx_k, ctx_v, *([] if sinks is None else [sinks]))
    except ValueError:
        return None
    _, Hq, B, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    window = sliding_window(window)
    n_ctx = ctx_k.shape[2] if n_ctx is None else n_ctx
    first = max(n_ctx - (window - 1), 0) if window is not None else 0
    queries = np.asarray(q)[0].reshape(Hkv, group * B, D) * np.float32(scale)
    ck, cv = np.asarray(ctx_k)[0, :, first:n_ctx], np.asarray(ctx_v)[0, :, first:n_ctx]
    seen = np.matmul(queries, ck.swapaxes(-1, -2)).reshape(Hkv, group, B, n_ctx - first)
    own = np.matmul(queries, np.asarray(k)[0].swapaxes(-1, -2)).reshape(Hkv, group, B, B)
    slot = np.arange(B)[:, None]
    if window is not None:  # slot i (position n_ctx + i) sees context positions above n_ctx + i - window
        np.copyto(seen, -np.inf, where=first + np.arange(n_ctx - first)[None] <= n_ctx + slot - window)
    if causal:
        np.copyto(own, -np.inf, where=np.arange(B)[None] > slot)
    top = np.maximum(seen.max(axis=-1, keepdims=True, initial=-np.inf), own.max(axis=-1, keepdims=True))
    if sinks is not None:
        sink = np.asarray(sinks.astype(mx.float32)).reshape(Hkv, group, 1, 1)
        top = np.maximum(top, sink)
    seen -= top
    own -= top
    np.exp(seen, out=seen)
    np.exp(own, out=own)
    total = seen.sum(axis=-1, keepdims=True) + own.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    out = (np.matmul(seen.reshape(Hkv, group * B, -1), cv) + np.matmul(own.reshape(Hkv, group * B, B),
                                                                        np.asarray(v)[0]))
    out = out.reshape(Hkv, group, B, D) / total
    return mx.array(out.reshape(1, Hq, B, D))


def block_attention(q: mx.array, k: mx.array, v: mx.array, ctx_k: mx.array, ctx_v: mx.array, *,
                    scale: float, window: Optional[int] = None, causal: bool = False,
                    sinks: Optional[mx.array] = None) -> mx.array:
    """The dispatcher: the kernel where Metal kernels are on and the shape is supported (never with attention
    `sinks`, which the kernel does not take); on MLX's CPU backend over a long float32 context the host's
    computation; else the reference."""
    if sinks is None and kernels_on() and kernel_supports(q, k, ctx_k):
        return block_attention_metal(q, k, v, ctx_k, ctx_v, scale=scale, window=window, causal=causal)
    if host_supports(q, k, ctx_k):
        out = block_attention_host(q, k, v, ctx_k, ctx_v, scale=scale, window=window, causal=causal, sinks=sinks)
        if out is not None:
            return out
    return block_attention_reference(q, k, v, ctx_k, ctx_v, scale=scale, window=window, causal=causal,
                                     sinks=sinks)
