"""The drafter's training forward: many blocks of a row in one masked pass, with the drafter's own modules.

Inference drafts one block after a growing context cache (`DFlashDrafter.__call__`). Training places A blocks in
one row of S context tokens and runs them together: the context K/V of every layer are computed once for the whole
row (positions 0..S-1), the blocks' queries and keys are rotated at their own positions a..a+B-1, and each
block attends to the context before its anchor and to itself (`masks.py`), in one softmax per query. Every
projection, norm and RoPE is the drafter's module, so trained weights load into `DFlashDrafter` unchanged, and one
block's output equals the inference forward on the same context (tests/test_train.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from . import fastmath
from ..drafters.dflash import DFlashDrafter, DraftAttention
from .masks import band_limits, context_mask, slot_mask


def _context_kv(attn: DraftAttention, ctx: mx.array):
    # ctx: [R, S, H] fused context -> keys, values [R, nKV, S, hd], keys rotated at 0..S-1 (as append_context).
    R, S, _ = ctx.shape
    k = attn.k_norm(attn.k_proj(ctx).reshape(R, S, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(ctx).reshape(R, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(k), v


def _block_attention(attn: DraftAttention, x: mx.array, ctx_k: mx.array, ctx_v: mx.array, anchors: mx.array,
                     ctx_mask: mx.array, slots: Optional[mx.array], bands: int = 1) -> mx.array:
    """Attention of every block over [its visible context, its own slots], as one softmax per query.

    Scores are computed against the context keys (masked per anchor) and the block's own B keys only, never
    against other blocks: S + B columns per query instead of S + A*B. With `bands` > 1 the anchors come in that
    many equal groups, group c's all at most `band_limits(S, bands)[c]` (`masks.sample_banded_anchors`), and
    group c scores only the context keys before that limit: the keys it skips are masked for all of its blocks
    anyway (a block sees positions before its anchor), so the result is the same with fewer columns.
    x: [R, A*B, H] normed block inputs; ctx_mask: [R, A, B or 1, S]; slots: [B, B] in-block mask (None: bidirectional).
    """
    R, AB, _ = x.shape
    A = anchors.shape[1]
    B = AB // A
    nH, nKV = attn.n_heads, attn.n_kv_heads
    G = nH // nKV  # GQA: query heads kv*G .. kv*G+G-1 share kv head kv

    def heads(y: mx.array, n: int) -> mx.array:  # [R, A*B, n*hd] -> [R*A, n, B, hd]
        return y.reshape(R * A, B, n, -1).transpose(0, 2, 1, 3)

    q = attn.q_norm(heads(attn.q_proj(x), nH))  # q/k norms act on each head vector
    k = attn.k_norm(heads(attn.k_proj(x), nKV))
    v = heads(attn.v_proj(x), nKV)
    offsets = anchors.reshape(-1)  # one RoPE offset per block: slot i sits at anchor + i
    q, k = attn.rope(q, offset=offsets) * attn.scale, attn.rope(k, offset=offsets)
    hd = q.shape[-1]
    q = q.reshape(R * A, nKV, G * B, hd)  # rows (g, i) per kv head
    s_blk = (q @ k.swapaxes(-1, -2)).reshape(R, A, nKV, G * B, B).transpose(0, 2, 1, 3, 4)  # [R, nKV, A, GB, B]
    if slots is not None:
        s_blk = mx.where(mx.tile(slots, (G, 1)), s_blk, -mx.inf)
    q_rows = q.reshape(R, A, nKV, G * B, hd).transpose(0, 2, 1, 3, 4)  # [R, nKV, A, GB, hd]
    S = ctx_k.shape[2]
    if ctx_mask.shape[2] > 1:  # a per-slot (sliding) window: rows are (g, slot), slot fastest
        ctx_mask = mx.tile(ctx_mask, (1, 1, G, 1))
    # One softmax over [context, own slots] without joining them: a shared shift m, exp of each part, and one
    # division of the (hd-wide) output by the total weight instead of the (S+B-wide) probabilities.
    n = A // bands
    o_ctx, e_blk, total = [], [], []
    for c, limit in enumerate(band_limits(S, bands)):
        group = slice(c * n, (c + 1) * n)
        s_ctx = (q_rows[:, :, group].reshape(R, nKV, n * G * B, hd) @ ctx_k[:, :, :limit].swapaxes(-1, -2))
        s_ctx = mx.where(ctx_mask[:, None, group, :, :limit], s_ctx.reshape(R, nKV, n, G * B, limit), -mx.inf)
        s_own = s_blk[:, :, group]
        m = mx.stop_gradient(mx.maximum(s_ctx.max(axis=-1), s_own.max(axis=-1)))[..., None]  # shift-invariant
        e_ctx, e_own = fastmath.exp(s_ctx - m), fastmath.exp(s_own - m)
        total.append(e_ctx.sum(axis=-1) + e_own.sum(axis=-1))  # [R, nKV, n, GB]
        o_ctx.append((e_ctx.reshape(R, nKV, n * G * B, limit) @ ctx_v[:, :, :limit]).reshape(R, nKV, n, G * B, hd))
        e_blk.append(e_own)
    o_ctx, e_blk, total = (parts[0] if bands == 1 else mx.concatenate(parts, axis=2) for parts in (o_ctx, e_blk, total))
    e_blk = e_blk.transpose(0, 2, 1, 3, 4).reshape(R * A, nKV, G * B, B)
    o_blk = (e_blk @ v).reshape(R, A, nKV, G * B, hd).transpose(0, 2, 1, 3, 4)  # [R, nKV, A, GB, hd]
    out = (o_ctx + o_blk) / total[..., None]
    out = out.reshape(R, nKV, A, G, B, hd)
    out = out.transpose(0, 2, 4, 1, 3, 5).reshape(R, AB, nH * hd)  # head index kv*G + g, as the o_proj expects
    return attn.o_proj(out)


def _mlp(mlp, x: mx.array) -> mx.array:
    # The layer's own SwiGLU MLP (mlx-lm's), with the SiLU from fastmath.
    return mlp.down_proj(fastmath.silu(mlp.gate_proj(x)) * mlp.up_proj(x))


def block_hidden(drafter: DFlashDrafter, embed: Callable[[mx.array], mx.array], features: mx.array,
                 tokens: mx.array, anchors: mx.array, mask_token_id: int, bands: int = 1) -> mx.array:
    """Final-normed hidden states [R, A, B-1, H] of block slots 1..B-1.

    features: [R, S, n*H] tapped target features of the row's tokens [R, S]; anchors: [R, A] positions with
    1 <= a <= S - B, in `bands` groups as `masks.sample_banded_anchors` draws them (1: anywhere).
    `drafter.draft_logits` turns the result into logits.
    """
    cfg = drafter.config
    R, S = tokens.shape
    A, B = anchors.shape[1], cfg.block_size
    ctx = drafter.hidden_norm(drafter.fc(features))
    first = mx.take_along_axis(tokens, anchors, axis=1)  # [R, A]: slot 0 holds the token at the anchor
    block_ids = mx.concatenate([first[..., None], mx.full((R, A, B - 1), mask_token_id, dtype=tokens.dtype)], -1)
    x = embed(block_ids.reshape(R, A * B))
    if cfg.input_embedding_scale is not None:
        x = x * cfg.input_embedding_scale
    masks = {}
    for layer in drafter.layers:
        attn = layer.self_attn
        key = (attn.sliding_window, attn.block_causal)
        if key not in masks:
            slots = slot_mask(B, causal=True) if attn.block_causal else None
            masks[key] = (context_mask(anchors, S, B, attn.sliding_window), slots)
        ctx_k, ctx_v = _context_kv(attn, ctx)
        h = x + _block_attention(attn, layer.input_layernorm(x), ctx_k, ctx_v, anchors, *masks[key], bands)
        x = h + _mlp(layer.mlp, layer.post_attention_layernorm(h))
    return drafter.norm(x.reshape(R, A, B, -1)[:, :, 1:])
