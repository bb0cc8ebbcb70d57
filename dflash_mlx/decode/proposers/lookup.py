"""Prompt lookup as a proposer: drafts copied from where the context's last n-gram occurred before.

The index (`decode.lookup.LookupIndex`) belongs to the conversation and outlives the generation (a chat's later
turns, a server's cached prefix). The copy is found on the host when the pass is planned, which is right after
the previous pass's sync, so it sees every committed token. Copied drafts are fixed in advance: the acceptor
treats them as a point-mass proposal, which keeps sampling exact.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..lookup import LookupIndex
from ..proposal import LOOKUP, Offer, Proposal
from ..state import DecodeState


class LookupProposer:
    name = LOOKUP

    widest = 1 << 30  # as long as the copy found; the planner bounds it (`Planner.widest`)

    def __init__(self, index: LookupIndex):
        self.index = index

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        found = self.index.propose(widest - 1)
        if found is None or not found.tokens:
            return None
        return Offer(LOOKUP, len(found.tokens) + 1, found.tokens, found.match)

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        copied = offer.tokens[: width - 1]
        return acceptor.propose_tokens(mx.array(copied, dtype=mx.int32))

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        self.index.extend(tokens)

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        pass  # copying changed nothing
