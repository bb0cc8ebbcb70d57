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

from typing import List, Optional

import mlx.core as mx
import numpy as np


def anchor_candidates(trainable: np.ndarray, block_size: int) -> np.ndarray:
    """Positions a that may anchor a block: a non-empty context (a >= 1), the whole block inside the row
    (a + B <= S) and a trainable first label (`trainable[a + 1]`, e.g. an assistant token)."""
    last = len(trainable) - block_size  # largest anchor whose block fits
    if last < 1:
        return np.zeros((0,), dtype=np.int64)
    candidates = np.arange(1, last + 1)
    if block_size > 1:
        candidates = candidates[trainable[candidates + 1] > 0]
    return candidates


def sample_anchors(rng: np.random.Generator, trainable: np.ndarray, num_anchors: int, block_size: int) -> np.ndarray:
    """Sorted anchor positions for one row, uniformly among its candidates (`anchor_candidates`).

    Distinct when there are enough candidates, otherwise drawn with replacement so every row yields the same number
    of blocks. Returns [] if the row has none.
    """
    candidates = anchor_candidates(trainable, block_size)
    if len(candidates) == 0:
        return np.zeros((0,), dtype=np.int32)
    picked = rng.choice(candidates, size=num_anchors, replace=len(candidates) < num_anchors)
    return np.sort(picked).astype(np.int32)


def band_limits(context_len: int, bands: int) -> List[int]:
    """Band c's anchors are at most limit c, so its blocks see context positions below it only."""
    return [context_len * (c + 1) // bands for c in range(bands)]


def sample_banded_anchors(rng: np.random.Generator, trainable: np.ndarray, num_anchors: int, block_size: int,
                          bands: int) -> Optional[np.ndarray]:
    """Sorted anchors for one row in `bands` groups of num_anchors / bands, so the training forward can give each
    group a shorter context (`band_limits`): the row's candidates split in position order into `bands` groups of
    equal size (±1), and each group gives the same number of anchors, distinct when it has enough.

    Every candidate has the same chance to be drawn as with `sample_anchors` (anchors per group / group size =
    anchors / candidates); only the spread is more even. None when a group reaches past its band's limit (labels
    bunched late in the row, e.g. one assistant turn at the end) or there are fewer candidates than bands: then
    draw with `sample_anchors` and train without bands.
    """
    candidates = anchor_candidates(trainable, block_size)
    if len(candidates) < bands or num_anchors % bands:
        return None
    groups = np.array_split(candidates, bands)
    if any(g[-1] > limit for g, limit in zip(groups, band_limits(len(trainable), bands))):
        return None
    n = num_anchors // bands
    return np.concatenate([np.sort(rng.choice(g, size=n, replace=len(g) < n)) for g in groups]).astype(np.int32)


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
