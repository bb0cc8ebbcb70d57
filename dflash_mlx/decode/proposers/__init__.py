"""Proposers: where a pass's drafts come from. One class per method, all with the shape of `Proposer`.

    name, widest                             its name (a pass's `source`) and the widest pass it can fill
    offer(state, widest) -> Offer | None    what it could draft now, before the width is chosen (None: nothing)
    propose(state, acceptor, width, offer) -> Proposal   the drafts of a `width`-token pass, drawn by the acceptor
    observe(state, tokens, features)         a pass committed `tokens` (their tapped features, [1, n, n*H])
    withdraw(state, proposal)                a proposal whose pass was abandoned before it committed: undo it

The pass step (`decode.step.Decoder`) asks each proposer for its offer, lets the planner choose one and a width,
has that proposer draft, verifies, and tells every proposer what was committed. A new drafting method is one new
module here: hand an instance to `loop.dflash_generate_step(..., proposer=)` (or `Generation`, `Batch`) and it
drafts where a drafter's blocks would, under the same planner, acceptance and rollback.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..proposal import Offer, Proposal
from ..state import DecodeState


class Proposer(Protocol):
    name: str
    widest: int

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]: ...

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal: ...

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None: ...

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None: ...
