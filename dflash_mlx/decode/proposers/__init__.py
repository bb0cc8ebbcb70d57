"""Proposers: where a pass's drafts come from. One class per method, each a `Proposer`.

    name, widest                             its name (a pass's `source`) and the widest pass it can fill
    offer(state, widest) -> Offer | None    what it could draft now, before the width is chosen (None: nothing)
    propose(state, acceptor, width, offer) -> Proposal   the drafts of a `width`-token pass, drawn by the acceptor
    observe(state, tokens, features)         a pass committed `tokens` (their tapped features, [1, n, n*H])
    withdraw(state, proposal)                a proposal whose pass was abandoned before it committed: undo it
and, with a default in `Proposer`:
    grows_trees(acceptor) -> bool            whether it can draft trees under this acceptance rule (the default:
                                             no, chains only); the planner is built with trees only where the
                                             drafting proposer can grow them (`planner.build_planner`)
    propose_tree(state, acceptor, width, budget, offer) -> TreeProposal | Proposal | None
                                             a tree of up to `budget` drafts at most `width - 1` deep, or a chain
                                             where a tree would not branch; None: no tree (the default), and the
                                             pass verifies the chain `propose` drafts
    unobserve(state, tokens)                 forget the newest `tokens` observed (another proposer's pass, taken
                                             back after it was observed); the default keeps nothing to forget

The pass step (`decode.step.Decoder`) asks each proposer for its offer, lets the planner choose one and a width,
has that proposer draft, verifies, and tells every proposer what was committed. A new drafting method is one new
module here: hand an instance to `loop.dflash_generate_step(..., proposer=)` (or `Generation`, `Batch`) and it
drafts where a drafter's blocks would, under the same planner, acceptance and rollback. An object of this shape
that does not derive from `Proposer` is adopted as one (`as_proposer`): its own optional methods where it has
them, the defaults where not.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..proposal import Offer, Proposal
from ..state import DecodeState


class Proposer:
    """The shape of a proposer (see the module docstring); subclasses give `name`, `widest` and the first four
    methods, and may replace the defaults of `propose_tree` and `unobserve`."""

    name: str
    widest: int

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        raise NotImplementedError

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        raise NotImplementedError

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        raise NotImplementedError

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        raise NotImplementedError

    def grows_trees(self, acceptor: Optional[Acceptor]) -> bool:
        return False  # chains only

    def propose_tree(self, state: DecodeState, acceptor: Acceptor, width: int, budget: int,
                     offer: Optional[Offer]) -> Optional[Proposal]:
        return None  # chains only

    def unobserve(self, state: DecodeState, tokens: int) -> None:
        pass  # nothing observed is kept past the pass


class _Adopted(Proposer):
    """A proposer written to the shape without deriving from `Proposer`: each call goes to it, the optional
    methods only where it has them."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def widest(self) -> int:
        return self.inner.widest

    def offer(self, state, widest):
        return self.inner.offer(state, widest)

    def propose(self, state, acceptor, width, offer):
        return self.inner.propose(state, acceptor, width, offer)

    def observe(self, state, tokens, features):
        self.inner.observe(state, tokens, features)

    def withdraw(self, state, proposal):
        self.inner.withdraw(state, proposal)

    def grows_trees(self, acceptor):
        # One with a `propose_tree` of its own may grow trees; it says so itself where it has `grows_trees`.
        says = getattr(self.inner, "grows_trees", None)
        return says(acceptor) if says is not None else hasattr(self.inner, "propose_tree")

    def propose_tree(self, state, acceptor, width, budget, offer):
        grow = getattr(self.inner, "propose_tree", None)
        return grow(state, acceptor, width, budget, offer) if grow is not None else None

    def unobserve(self, state, tokens):
        forget = getattr(self.inner, "unobserve", None)
        if forget is not None:
            forget(state, tokens)


def as_proposer(proposer) -> Proposer:
    """`proposer` as a `Proposer` (itself when it derives from one)."""
    return proposer if isinstance(proposer, Proposer) else _Adopted(proposer)
