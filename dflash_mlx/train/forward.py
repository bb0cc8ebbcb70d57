"""The drafter's training forward: many blocks of a row in one masked pass, with the drafter's own modules.

Inference drafts one block after a growing context cache (`DFlashDrafter.__call__`). Training places A blocks in
one row of S context tokens and runs them together: the context K/V of every layer are computed once for the whole
row (positions 0..S-1), the blocks' queries and keys are rotated at their own positions a..a+B-1, and
`masks.block_mask` keeps each block to the context before its anchor and to itself. Every projection, norm and
RoPE is the drafter's module, so trained weights load into `DFlashDrafter` unchanged, and one block's output
equals the inference forward on the same context (tests/test_train.py).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..drafter import DFlashDrafter, DraftAttention
from .masks import block_mask


def _context_kv(attn: DraftAttention, ctx: mx.array):
    # ctx: [R, S, H] fused context -> keys, values [R, nKV, S, hd], keys rotated at 0..S-1 (as append_context).
    R, S, _ = ctx.shape
    k = attn.k_norm(attn.k_proj(ctx).reshape(R, S, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(ctx).reshape(R, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(k), v


def _block_attention(attn: DraftAttention, x: mx.array, ctx_k: mx.array, ctx_v: mx.array, anchors: mx.array,
                     mask: mx.array) -> mx.array:
    # x: [R, A*B, H] normed block inputs; anchors [R, A]; mask [R, 1, A*B, S + A*B].
    R, AB, _ = x.shape
    A = anchors.shape[1]
    B = AB // A

    def heads(y: mx.array, n: int) -> mx.array:  # [R, A*B, n*hd] -> [R*A, n, B, hd]
        return y.reshape(R * A, B, n, -1).transpose(0, 2, 1, 3)

    def rows(y: mx.array) -> mx.array:  # [R*A, n, B, hd] -> [R, n, A*B, hd]
        n, hd = y.shape[1], y.shape[3]
        return y.reshape(R, A, n, B, hd).transpose(0, 2, 1, 3, 4).reshape(R, n, AB, hd)

    q = attn.q_norm(heads(attn.q_proj(x), attn.n_heads))  # q/k norms act on each head vector
    k = attn.k_norm(heads(attn.k_proj(x), attn.n_kv_heads))
    v = heads(attn.v_proj(x), attn.n_kv_heads)
    offsets = anchors.reshape(-1)  # one RoPE offset per block: slot i sits at anchor + i
    q, k = rows(attn.rope(q, offset=offsets)), rows(attn.rope(k, offset=offsets))
    keys = mx.concatenate([ctx_k, k], axis=2)
    values = mx.concatenate([ctx_v, rows(v)], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(R, AB, -1))


def block_hidden(drafter: DFlashDrafter, embed: Callable[[mx.array], mx.array], features: mx.array,
                 tokens: mx.array, anchors: mx.array, mask_token_id: int) -> mx.array:
    """Final-normed hidden states [R, A, B-1, H] of block slots 1..B-1.

    features: [R, S, n*H] tapped target features of the row's tokens [R, S]; anchors: [R, A] positions with
    1 <= a <= S - B. `drafter.draft_logits` turns the result into logits.
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
            masks[key] = block_mask(anchors, S, B, attn.sliding_window, attn.block_causal)
        ctx_k, ctx_v = _context_kv(attn, ctx)
        h = x + _block_attention(attn, layer.input_layernorm(x), ctx_k, ctx_v, anchors, masks[key])
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(x.reshape(R, A, B, -1)[:, :, 1:])
