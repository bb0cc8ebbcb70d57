"""An offer and a proposal: what a proposer could draft before a pass, and the drafts the pass verifies, handed as
a value from the proposer through the acceptor to the verify.

A proposal's `tokens` are the drafts (block slots 1..n; slot 0 is the last committed token). `logq` holds, when the acceptor
samples, the log proposal distribution each draft was drawn from (row i for draft i), exactly what rejection
sampling divides by; `point_mass` says the drafts were fixed in advance (copied from the context), so q is a
one-hot on each and the acceptor builds those rows once it knows the vocabulary. Greedy acceptance reads the tokens
alone. `confidence` is a drafter's own per-slot acceptance estimate (a DSpark confidence head), read by the planner
to cut the block short; `flushed` the tapped features the drafter's forward moved into its cache, restored if the
pass is withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import mlx.core as mx

# Proposers by name: the DFlash family's drafter, prompt lookup, none (the MTP proposer names itself "mtp").
DFLASH, LOOKUP, PLAIN = "dflash", "lookup", "plain"


def is_drafted(source: str) -> bool:
    """Whether a pass from `source` was drafted by a drafting proposer (a DFlash drafter's block, a target's MTP
    layers, any proposer a caller plugs in), rather than copied from the context (lookup) or not drafted (plain)."""
    return source not in (LOOKUP, PLAIN)


@dataclass
class Offer:
    """What a proposer could draft for the next pass, before the planner chooses its width."""

    source: str
    max_width: int  # the widest pass it can fill (drafts + 1)
    tokens: Optional[List[int]] = None  # drafts known before drafting (lookup: the copied continuation)
    match: int = 0  # lookup: match length
    rates: Optional[List[float]] = None  # per-slot acceptance estimates the proposer supplies


@dataclass
class Proposal:
    tokens: mx.array  # [n] draft tokens (lazy)
    logq: Optional[mx.array] = None  # [n, V] log q of each draft's row (sampling acceptors only)
    point_mass: bool = False  # drafts fixed in advance: q is one-hot on each
    source: str = PLAIN  # the proposer that made it (the pass step labels it with the planner's choice)
    confidence: Optional[mx.array] = None  # [n] per-slot acceptance estimates (a confidence head)
    flushed: Optional[mx.array] = None  # [1, S, n*H] features moved into the draft cache by drafting it

    @property
    def width(self) -> int:
        """Tokens the pass verifies: the last committed token and the drafts."""
        return int(self.tokens.shape[-1]) + 1

    def cut(self, drafts: int) -> "Proposal":
        """The first `drafts` drafts with their rows. Exact for sampling when whether slot i is verified depends
        only on the drafts before it (a stopping time)."""
        return replace(self, tokens=self.tokens[:drafts], logq=None if self.logq is None else self.logq[:drafts],
                       confidence=None if self.confidence is None else self.confidence[:drafts])

    @classmethod
    def empty(cls) -> "Proposal":
        """No drafts: a plain decoding step."""
        return cls(mx.zeros((0,), dtype=mx.int32), source=PLAIN)


@dataclass
class TreeProposal(Proposal):
    """Drafts as a tree, verified in one pass: `tokens[i]` is block slot i+1 and its parent is block slot
    `parents[i]` (0: the root, slot 0, the last committed token). Parents come before their children
    (`parents[i] <= i`), so any first-n nodes are a tree too (`cut` keeps them). Siblings are tried in slot
    order. `logq` row i is the distribution node i was drawn from (siblings drawn from one row share it);
    `point_mass` nodes were fixed in advance (q one-hot on each token)."""

    parents: Tuple[int, ...] = ()

    @property
    def depths(self) -> List[int]:
        """Depth of every block slot (slot 0, the root, is depth 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def cut(self, drafts: int) -> "TreeProposal":
        cut = super().cut(drafts)
        return replace(cut, parents=tuple(self.parents[:drafts]))
