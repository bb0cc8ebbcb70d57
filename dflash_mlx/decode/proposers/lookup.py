"""Prompt lookup as a proposer: drafts copied from where the context's last n-gram occurred before.

The index (`decode.lookup.LookupIndex`) belongs to the conversation and outlives the generation (a chat's later
turns, a server's cached prefix). The copy is found on the host when the pass is planned, which is right after
the previous pass's sync, so it sees every committed token. Copied drafts are fixed in advance: the acceptor
treats them as a point-mass proposal, which keeps sampling exact. With a tree budget, the continuations of several
earlier occurrences merge into one tree (`decode.tree.lookup_tree`), verified in one pass.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..acceptance import Acceptor
from ..lookup import LookupIndex
from ..proposal import LOOKUP, Offer, Proposal
from ..state import DecodeState
from ..tree import lookup_tree
from . import Proposer


BRANCHES = 4  # earlier occurrences a lookup tree follows


class LookupProposer(Proposer):
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

    def grows_trees(self, acceptor: Optional[Acceptor]) -> bool:
        return True  # copies from several earlier occurrences, whatever the acceptance rule

    def propose_tree(self, state: DecodeState, acceptor: Acceptor, width: int, budget: int,
                     offer: Optional[Offer]) -> Proposal:
        """The continuations of up to `BRANCHES` earlier occurrences as one tree of at most max(budget, width - 1)
        nodes, `width - 1` deep (the planner's width: what the generation may still commit); the chain where there
        is only one."""
        tree = lookup_tree(self.index, max(budget, width - 1) + 1, BRANCHES, deepest=width - 1)
        if tree is None or all(p == i for i, p in enumerate(tree.parents)):
            return self.propose(state, acceptor, width, offer)
        return tree

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        self.index.extend(tokens)

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        pass  # copying changed nothing
