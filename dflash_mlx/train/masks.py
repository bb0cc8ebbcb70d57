"""Where the training blocks sit and what each one may see.

A training row is one packed sequence of S tokens. Each anchor a in it makes a block [token a, MASK x (B-1)] at
positions a..a+B-1, exactly what the drafter sees at inference when the committed context ends at a-1 (the token at
a is the last committed one, not yet in the draft cache). A block sees the context strictly before its anchor and
its own B slots (bidirectionally), nothing else: never another block. Recipe: docs/algorithm.md, "Training".

Anchors are drawn uniformly among a row's candidates. `sample_banded_anchors` draws them in position groups (the
same chance for every candidate) so that the blocks of group c need only the context before a fixed limit: the
training forward then scores each group against that much context instead of the whole row (`forward.py`).

The mask factors into a context part (`context_mask`, per anchor) and an in-block part (`slot_mask`, the same for
every block); `forward.py` uses the factors so no block pays for the others' keys. `block_mask` assembles the
dense mask over keys [context, all blocks] that the factors stand for.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .recipe import anchor_candidates, band_limits, sample_anchors, sample_banded_anchors  # noqa: F401 (re-exported)


def context_mask(anchors: mx.array, context_len: int, block_size: int,
                 sliding_window: Optional[int] = None) -> mx.array:
    """[R, A, B, S] (B = 1 without a window): slot i of the block at anchor a may see context position p iff
    p < a and, on a sliding layer, p > a + i - sliding_window (the inference window over absolute positions)."""
    pos = mx.arange(context_len)[None, None, None]
    anchor = anchors[:, :, None, None]
    sees = pos < anchor
    if sliding_window is not None:
        slot = mx.arange(block_size)[None, None, :, None]
        sees = sees & (pos > anchor + slot - sliding_window)
    return sees


def slot_mask(block_size: int, causal: bool = False) -> mx.array:
    """[B, B]: slot i may see slot j of its own block (all of them, or j <= i on a causal sliding layer)."""
    i = mx.arange(block_size)
    return (i[None, :] <= i[:, None]) if causal else mx.ones((block_size, block_size), dtype=mx.bool_)


def block_mask(anchors: mx.array, context_len: int, block_size: int, sliding_window: Optional[int] = None,
               block_causal: bool = False) -> mx.array:
    """Dense boolean mask [R, 1, A*B, S + A*B] (True: may attend) for anchors [R, A] over keys [context, blocks]."""
    R, A = anchors.shape
    B = block_size
    sees_ctx = mx.broadcast_to(context_mask(anchors, context_len, B, sliding_window), (R, A, B, context_len))
    sees_ctx = sees_ctx.reshape(R, A * B, context_len)
    block_of = mx.arange(A * B) // B
    slot = mx.arange(A * B) % B
    same = block_of[:, None] == block_of[None, :]
    sees_blk = same & slot_mask(B, block_causal)[slot[:, None], slot[None, :]]
    sees_blk = mx.broadcast_to(sees_blk[None], (R, A * B, A * B))
    return mx.concatenate([sees_ctx, sees_blk], axis=-1)[:, None]
