"""Plain decoding as a proposer: no drafts, so the pass verifies the last committed token alone."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..proposal import PLAIN, Offer, Proposal
from ..state import DecodeState
from . import Proposer


class PlainProposer(Proposer):
    name = PLAIN
    widest = 1

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        return None  # nothing to weigh: the planner always has width 1

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        return Proposal.empty()

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        pass

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        pass
