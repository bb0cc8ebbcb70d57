"""The block loss: cross-entropy on slots 1..B-1 weighted exp(-(k-1)/γ), optionally mixed with the target's own
distribution (its top-k, cached with the features), plus the statistics the progress bar shows.

Early slots weigh most because a draft is accepted only up to its first miss. Recipe: docs/algorithm.md, "Training".
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from . import fastmath
from .recipe import default_gamma, slot_weights  # noqa: F401 (re-exported)


def logsumexp(x: mx.array) -> mx.array:
    """logsumexp over the last axis whose gradient reuses the forward's softmax: one exp per logit instead of two
    (exp dominates the loss on CPU; see fastmath.py)."""
    return fastmath.lse_softmax(x)[0]


def block_loss(logits: mx.array, labels: mx.array, weights: mx.array, teacher_ids: Optional[mx.array] = None,
               teacher_logp: Optional[mx.array] = None, kl: float = 0.0):
    """Weighted loss over every block slot, and detached statistics.

    logits: [R, A, B-1, V] over the drafter's vocabulary; labels: [R, A, B-1] ids in that vocabulary, -1 for
    slots without a loss (outside a trainable span, or a token the reduced vocabulary lacks); weights: [B-1].
    teacher_ids / teacher_logp: [R, A, B-1, k] the target's top-k for each slot (ids -1 where absent), used with
    weight `kl`: loss = (1 - kl) * CE(labels) + kl * CE(target top-k distribution, renormalized).

    Returns (loss, stats) where stats holds scalar arrays: ce, soft (if kl), acc1 (slot-1 accuracy) and tau (the
    acceptance length a greedy verify would give on these blocks if the labels were the target's choices).
    """
    valid = labels >= 0
    lse = logsumexp(logits)
    picked = mx.take_along_axis(logits, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    w = weights * valid
    ce = ((lse - picked) * w).sum() / mx.maximum(w.sum(), 1e-6)
    loss = ce
    stats: Dict[str, mx.array] = {"ce": ce}
    if kl > 0 and teacher_ids is not None:
        present = teacher_ids >= 0
        p = mx.where(present, mx.exp(teacher_logp.astype(mx.float32)), 0.0)
        p = p / mx.maximum(p.sum(-1, keepdims=True), 1e-9)
        lt = mx.take_along_axis(logits, mx.maximum(teacher_ids, 0), axis=-1)
        soft_slot = (p * (lse[..., None] - lt)).sum(-1)
        wt = weights * present.any(-1)
        soft = (soft_slot * wt).sum() / mx.maximum(wt.sum(), 1e-6)
        loss = (1 - kl) * ce + kl * soft
        stats["soft"] = soft
    correct = mx.stop_gradient((mx.argmax(logits, axis=-1) == labels) & valid)
    stats["acc1"] = correct[..., 0].sum() / mx.maximum(valid[..., 0].sum(), 1)
    stats["tau"] = 1 + mx.cumprod(correct.astype(mx.float32), axis=-1).sum(-1).mean()
    return loss, stats
