"""A reduced draft vocabulary: the N most frequent target tokens of the data, and its id maps.

Speculators convention: draft id i stands for target id i + d2t[i]. Draft ids are assigned in increasing target-id
order, so d2t is non-decreasing and non-negative. The reduced LM head starts as the target's head rows of those ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Tuple

import numpy as np

from ..errors import DFlashError

if TYPE_CHECKING:  # MLX is imported where the head is read, so the id maps work without it
    import mlx.core as mx


def select_vocab(tokens: np.ndarray, trainable: np.ndarray, size: int, vocab_size: int,
                 always: Iterable[int] = ()) -> np.ndarray:
    """Sorted target ids of the `size` most frequent trainable tokens, `always` (e.g. EOS) included."""
    if not 0 < size <= vocab_size:
        raise DFlashError(f"--draft-vocab {size} must be between 1 and the target's vocabulary size {vocab_size}")
    labels = np.asarray(tokens)[np.asarray(trainable) > 0]
    counts = np.bincount(labels.ravel(), minlength=vocab_size).astype(np.float64)
    counts[list(always)] = np.inf
    # Ties (and unseen tokens) by id, so the choice is deterministic.
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int64)


def maps(draft_ids: np.ndarray, vocab_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(d2t offsets [N] int32, t2d [V] int32 with -1 for target ids outside the draft vocabulary)."""
    d2t = (draft_ids - np.arange(len(draft_ids))).astype(np.int32)
    t2d = np.full(vocab_size, -1, dtype=np.int32)
    t2d[draft_ids] = np.arange(len(draft_ids), dtype=np.int32)
    return d2t, t2d


def head_rows(target, draft_ids: np.ndarray, chunk: int = 4096) -> "mx.array":
    """The target head's rows [N, H] for `draft_ids`, read off the head itself (tied, untied or quantized).

    head(e_j) for the unit vectors e_j gives column j of W^T, so W[ids] = head(I)[:, ids]^T, computed in chunks.
    The target's logit soft-cap is skipped (the drafter applies its own).
    """
    import mlx.core as mx

    H = target.hidden_size
    eye = mx.eye(H, dtype=mx.float32)
    ids = mx.array(draft_ids.astype(np.int32))
    cols = []
    for begin in range(0, H, chunk):
        logits = target.head(eye[begin : begin + chunk][None], softcap=False)[0]  # [h, V]
        cols.append(mx.take(logits, ids, axis=1))
        mx.eval(cols[-1])
    return mx.concatenate(cols, axis=0).T
