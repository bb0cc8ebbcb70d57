"""Where the training blocks sit and what each one may see.

A training row is one packed sequence of S tokens. Each anchor a in it makes a block [token a, MASK x (B-1)] at
positions a..a+B-1, exactly what the drafter sees at inference when the committed context ends at a-1 (the token at
a is the last committed one, not yet in the draft cache). The attention mask over keys [context 0..S-1, all blocks]
lets a block see the context strictly before its anchor and its own B slots (bidirectionally), nothing else.
Recipe: dflash-reference.md section 5.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np


def sample_anchors(rng: np.random.Generator, trainable: np.ndarray, num_anchors: int, block_size: int) -> np.ndarray:
    """Sorted anchor positions for one row.

    An anchor a needs a non-empty context (a >= 1), a whole block inside the row (a + B <= S), and a trainable
    first label (`trainable[a + 1]`, e.g. an assistant token). Distinct when there are enough candidates, otherwise
    drawn with replacement so every row yields the same number of blocks. Returns [] if the row has none.
    """
    S = len(trainable)
    last = S - block_size  # largest anchor whose block fits
    if last < 1:
        return np.zeros((0,), dtype=np.int32)
    candidates = np.arange(1, last + 1)
    if block_size > 1:
        candidates = candidates[trainable[candidates + 1] > 0]
    if len(candidates) == 0:
        return np.zeros((0,), dtype=np.int32)
    picked = rng.choice(candidates, size=num_anchors, replace=len(candidates) < num_anchors)
    return np.sort(picked).astype(np.int32)


def block_mask(anchors: mx.array, context_len: int, block_size: int, sliding_window: Optional[int] = None,
               block_causal: bool = False) -> mx.array:
    """Boolean mask [R, 1, A*B, S + A*B] (True: may attend) for anchors [R, A] over keys [context, blocks].

    `sliding_window` and `block_causal` reproduce a sliding draft layer: at most `sliding_window - 1` context keys
    and, if causal, slot i sees block slots 0..i only.
    """
    R, A = anchors.shape
    B, S = block_size, context_len
    anchor = mx.repeat(anchors, B, axis=1)[:, :, None]  # [R, A*B, 1]: the anchor of each query
    pos = mx.arange(S)[None, None]
    sees_ctx = pos < anchor
    if sliding_window is not None:
        sees_ctx = sees_ctx & (pos >= anchor - (sliding_window - 1))
    block_of = mx.arange(A * B) // B
    sees_blk = block_of[:, None] == block_of[None, :]  # [A*B, A*B]
    if block_causal:
        slot = mx.arange(A * B) % B
        sees_blk = sees_blk & (slot[None, :] <= slot[:, None])
    sees_blk = mx.broadcast_to(sees_blk[None], (R, A * B, A * B))
    return mx.concatenate([sees_ctx, sees_blk], axis=-1)[:, None]
