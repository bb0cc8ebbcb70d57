"""The DFlash drafter as a proposer: one block of drafts per pass, conditioned on the target's tapped features.

Every drafter family adapts here, once, when the proposer is built:
- a block drafter (DFlash 1, the oracle) gives logits for all slots at once; the acceptor draws from them, and
  greedy acceptance asks for the argmax alone when the drafter can give it without the full-vocabulary logits;
- a walk drafter (DSpark's Markov head, DFlash 2's candidate selector) proposes slot i given draft i-1: the
  acceptor walks it (`acceptance.DraftWalk`);
- a walk with a confidence head (DSpark) also attaches its per-slot acceptance estimates to the proposal, for the
  planner to cut the block short (`Planner.cut`).

A block drafter's per-slot distributions also give a draft tree (`propose_tree`: DDTree's best-first tree of up to
`budget` nodes, `decode.tree.propose_tree`), verified in one target pass. A walk drafter drafts chains only (its
slot i is conditioned on one draft i-1).

The features of committed tokens wait in `state.pending_context` until the next block is drafted (they are added
to the draft cache then, in one call); a withdrawn proposal gives them back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, List, Optional, Protocol, Sequence

import mlx.core as mx

from ...errors import DFlashError
from ..acceptance import Acceptor, GreedyAcceptor
from ..proposal import DFLASH, Offer, Proposal
from ..state import DecodeState
from ..tree import propose_tree
from . import Proposer


class Drafter(Protocol):
    """What a drafter gives the proposer (`drafters.dflash.DFlashDrafter`, `drafters.oracle.OracleDrafter`).

    Optional: `greedy_draft(block_ids, cache) -> ids [1, B-1]` (the argmax without full logits);
    `draft_walk(block_ids, cache) -> DraftWalk` for drafters whose slot i depends on draft i-1, with
    `has_confidence` when the walk estimates each slot's acceptance (`walk.confidence()`).
    """

    block_size: int
    mask_token_id: Optional[int]

    def make_cache(self) -> List[Any]: ...

    def append_context(self, target_hidden: mx.array, cache: List[Any]) -> None: ...

    def rollback(self, cache: List[Any], num_tokens: int) -> None: ...

    def __call__(self, block_ids: mx.array, cache: List[Any]) -> mx.array: ...


class DFlashProposer(Proposer):
    name = DFLASH

    def __init__(self, drafter: Drafter, mask_token_id: Optional[int] = None):
        self.drafter = drafter
        self.mask_token_id = drafter.mask_token_id if mask_token_id is None else mask_token_id
        self._draw = self._family_draw(drafter)

    @property
    def widest(self) -> int:
        return self.drafter.block_size

    def check_mask(self) -> None:
        if self.mask_token_id is None:
            raise DFlashError("the drafter config has no mask_token_id; set it in the drafter's config.json")

    @staticmethod
    def _family_draw(drafter) -> Callable[[mx.array, List[Any], Acceptor, int], Proposal]:
        """How this drafter's block becomes a proposal (see the module docstring)."""
        walk = getattr(drafter, "draft_walk", None)
        if walk is not None:
            confident = bool(getattr(drafter, "has_confidence", False))

            def walked(block_ids, cache, acceptor, anchor):
                w = walk(block_ids, cache)
                proposal = acceptor.propose_walk(w, anchor)
                return replace(proposal, confidence=w.confidence()) if confident else proposal
            return walked
        greedy = getattr(drafter, "greedy_draft", None)

        def block(block_ids, cache, acceptor, anchor):
            if greedy is not None and isinstance(acceptor, GreedyAcceptor):
                return Proposal(greedy(block_ids, cache)[0])  # greedy needs only the argmax
            return acceptor.propose(drafter(block_ids, cache)[0])
        return block

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        return Offer(DFLASH, min(widest, self.drafter.block_size))

    def _block(self, state: DecodeState, width: int):
        """(the features flushed into the draft cache, the block ids [1, width] to draft from)."""
        self.check_mask()
        flushed = state.flush_context(self.drafter)
        return flushed, mx.array([[state.last_token] + [self.mask_token_id] * (width - 1)], dtype=mx.int32)

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        flushed, block_ids = self._block(state, width)
        proposal = self._draw(block_ids, state.draft_cache, acceptor, state.last_token)
        return replace(proposal, flushed=flushed)

    def grows_trees(self, acceptor: Optional[Acceptor]) -> bool:
        """Not for a walk drafter (its slot i is drawn given one draft i-1), nor with logits processors (they would
        make each node's row depend on its own path)."""
        return getattr(self.drafter, "draft_walk", None) is None and not getattr(acceptor, "processors", None)

    def propose_tree(self, state: DecodeState, acceptor: Acceptor, width: int, budget: int,
                     offer: Optional[Offer]) -> Proposal:
        """A tree of up to `budget` drafts at most `width - 1` deep from one block's distributions; None (nothing
        done) where this drafter or acceptor cannot make one (`grows_trees`)."""
        if not self.grows_trees(acceptor):
            return None
        flushed, block_ids = self._block(state, min(width, self.drafter.block_size))
        own_vocabulary = getattr(self.drafter, "tree_logits", None)
        if own_vocabulary is not None and isinstance(acceptor, GreedyAcceptor):
            # Ranked over the drafter's own vocabulary: the same tree, without the full-vocabulary logits.
            logits, columns = own_vocabulary(block_ids, state.draft_cache)
            return replace(propose_tree(logits[0], acceptor, budget, columns), flushed=flushed)
        logits = self.drafter(block_ids, state.draft_cache)[0]
        proposal = propose_tree(logits, acceptor, budget)
        if proposal is None:
            proposal = acceptor.propose(logits)
        return replace(proposal, flushed=flushed)

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        state.add_context(features)

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        if proposal.flushed is not None:
            self.drafter.rollback(state.draft_cache, proposal.flushed.shape[1])
            state.pending_context = proposal.flushed
