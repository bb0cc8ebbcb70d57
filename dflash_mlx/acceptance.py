"""Acceptance rules: how draft tokens are proposed from the drafter's logits and which of them the target keeps.

An acceptor turns one verify pass into `(acc, fix)`: `acc` draft tokens are accepted and `fix[acc]` is the
target's own token after them (the bonus, or the correction at the first rejection). Everything stays on the
device so a cycle needs a single host sync. Greedy is the fast special case; sampling plugs in here too.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx


class GreedyAcceptor:
    """Temperature 0: propose the drafter's argmax, keep drafts while they equal the target's argmax."""

    def first(self, logits: mx.array) -> mx.array:
        """The token after the prompt, from the prefill's last logits [V]."""
        return mx.argmax(logits, axis=-1)

    def propose(self, draft_logits: mx.array) -> mx.array:
        """Draft tokens [B-1] from draft logits [B-1, V]."""
        return mx.argmax(draft_logits, axis=-1).astype(mx.int32)

    def verify(self, draft: mx.array, draft_logits: mx.array, target_logits: mx.array) -> Tuple[mx.array, mx.array]:
        """draft [B-1], draft_logits [B-1, V], target_logits [B, V] -> (acc scalar, fix [B])."""
        choice = mx.argmax(target_logits, axis=-1).astype(mx.int32)
        if draft.size == 0:
            return mx.array(0, dtype=mx.int32), choice
        # acc = length of the longest prefix of drafts equal to the target's own choices.
        acc = mx.cumprod((draft == choice[:-1]).astype(mx.int32)).sum()
        return acc.astype(mx.int32), choice
