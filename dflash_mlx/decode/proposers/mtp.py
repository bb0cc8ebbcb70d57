"""The target's MTP layers as a proposer: k drafts per pass, each from the MTP's previous output.

Draft 1 comes from the seed: the MTP output of the newest (hidden row, token) pair, which predicts the token after
the last committed one. Drafts 2..k each run one more MTP step on the previous step's output (standing in for the
target hidden state not computed yet) and the previous draft; those k-1 steps are appended to the MTP's KV cache.
The acceptor walks the drafts (`acceptance.DraftWalk`), so greedy acceptance and exact rejection sampling both
come for free.

After the verify, the cache keeps what the reference implementation keeps: the chain entries of accepted drafts
(min(accepted, k-1) of them, computed from the MTP's own outputs), and the committed positions after them wait as
(target hidden row, next token) pairs, run at the next proposal in one call. `withdraw` restores the cache and the
waiting pairs as they were before `propose`, whether or not the pass was observed since.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..proposal import Offer, Proposal
from ..state import DecodeState
from . import Proposer

MTP = "mtp"


class MTPWalk:
    """Row 0 is the seed's logits; row i >= 1 runs one MTP step on (draft i-1, previous output)."""

    def __init__(self, drafter, cache: List[Any], seed: mx.array, length: int):
        self.drafter, self.cache, self.length = drafter, cache, length
        self.hidden = seed  # [1, 1, H]

    def row(self, i: int, prev: mx.array) -> mx.array:
        if i > 0:
            self.hidden = self.drafter.forward(prev.reshape(1, 1), self.hidden, self.cache)
        return self.drafter.logits(self.hidden)[0, 0]


class _Undo:
    """What `withdraw` restores: the cache length and the waiting pairs before the proposal."""

    def __init__(self, tokens: mx.array, offset: int, pending, chain: int):
        self.tokens, self.offset, self.pending, self.chain = tokens, offset, pending, chain
        self.observed = False


class MTPProposer(Proposer):
    name = MTP

    def __init__(self, drafter):
        self.drafter = drafter
        self._undo: Optional[_Undo] = None  # the newest proposal of this generation

    @property
    def widest(self) -> int:
        return self.drafter.block_size

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        return Offer(MTP, min(widest, self.drafter.block_size))

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        cache = state.draft_cache
        before = cache[-1].copy()
        offset = cache[0].offset if len(cache) > 1 else 0
        self.drafter.run_ready(cache)
        seed = cache[-1].seed
        if seed is None:
            raise RuntimeError("the MTP has no seed: the prompt was not prefilled through this drafter")
        proposal = acceptor.propose_walk(MTPWalk(self.drafter, cache, seed, width - 1), state.last_token)
        self._undo = _Undo(proposal.tokens, offset, before, max(width - 2, 0))
        return proposal

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        cache = state.draft_cache
        if cache is None:
            return
        keep = 0
        undo = self._undo
        if undo is not None and not undo.observed and features is not None:
            # Our proposal was verified: keep the chain entries of accepted drafts, drop the rest.
            undo.observed = True
            drafts = undo.tokens.tolist()  # computed by the pass's sync already
            accepted = next((i for i, (t, d) in enumerate(zip(tokens, drafts)) if t != d), min(len(tokens),
                                                                                                  len(drafts)))
            keep = min(accepted, undo.chain)
            self.drafter.rollback(cache, undo.chain - keep)
        if features is not None:
            self.drafter.add_rows(cache, features)  # they run at the next proposal, in one call
        self.drafter.add_tokens(cache, tokens)
        if keep:
            self.drafter.drop_pairs(cache, keep)  # those positions are in the cache as chain entries

    def unobserve(self, state: DecodeState, tokens: int) -> None:
        """Forget the newest `tokens` observed (a pass of another proposer taken back after it was observed):
        their pairs still wait, unrun, until the next proposal."""
        self.drafter.drop_newest(state.draft_cache, tokens)

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        undo = self._undo
        if undo is None or undo.tokens is not proposal.tokens:
            return
        cache = state.draft_cache
        self.drafter.rollback(cache, cache[0].offset - undo.offset if len(cache) > 1 else 0)
        cache[-1] = undo.pending
        self._undo = None
