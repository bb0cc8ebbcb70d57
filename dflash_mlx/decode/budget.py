"""Tree budgets: whether a drafting pass verifies the drafter's block as a chain or as a DDTree of up to B nodes.

A tree spends verify rows on the drafter's second and third choices where its first is unsure; whether that pays
depends on the machine (a memory-bound GPU verifies 8 rows for little more than 1; this CPU pays per row) and on
the drafter.

- `FixedBudget(B)`: every drafting pass is a tree of up to B nodes (`tree_budget=B`); the width policy still
  decides which passes draft.
- `TreeBudget` (`tree_budget="auto"`): before every pass, a tree of one of a few budgets or whatever the width
  policy chooses (the arm `CHAIN`: plain decoding, lookup or a chain), by measured committed tokens per second,
  each arm's tokens and seconds summed with a fading weight. Every arm is tried a few times first; afterwards the
  arm tried least recently is re-measured once every `explore_every` passes, so the choice follows a drafter whose
  acceptance changes at a bounded price (at most one pass in `explore_every` runs a worse arm), and trees never
  replace the policy's passes unless they were measured faster.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

CHAIN = None  # the arm that verifies the block as a chain


class FixedBudget:
    """Always a tree of up to `budget` nodes."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {budget}")
        self.budget = budget

    def choose(self) -> Optional[int]:
        return self.budget

    def record(self, budget: Optional[int], committed: int, seconds: float, rows: int) -> None:
        pass


class TreeBudget:
    """Chain or tree, by measured tokens per second; see the module docstring.

    Args:
        budgets: the tree budgets to choose among (besides the chain).
        warmup: passes each arm runs before the rates are compared.
        explore_every: passes between two re-measurements of the arm tried least recently.
        decay: weight kept by an arm's sums from one of its passes to the next.
        cost: seconds of a pass by its verified rows, used instead of the clock (seeded sampling: the choices then
            follow acceptance alone, so a seed reproduces a run on any machine).
    """

    def __init__(self, budgets: Sequence[int] = (4, 8, 16), *, warmup: int = 2, explore_every: int = 24,
                 decay: float = 0.9, cost: Optional[Callable[[int], float]] = None):
        self.arms = [CHAIN] + sorted(set(int(b) for b in budgets if b >= 1))
        self.warmup, self.explore_every, self.decay, self.cost = warmup, explore_every, decay, cost
        self.tokens: Dict[Optional[int], float] = {a: 0.0 for a in self.arms}
        self.seconds: Dict[Optional[int], float] = {a: 0.0 for a in self.arms}
        self.tries: Dict[Optional[int], int] = {a: 0 for a in self.arms}
        self.last: Dict[Optional[int], int] = {a: -1 for a in self.arms}
        self.passes = 0

    def rate(self, arm: Optional[int]) -> float:
        """Committed tokens per second of `arm` so far (0 before it ran)."""
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def best(self) -> Optional[int]:
        top = max(self.rate(a) for a in self.arms)
        return next(a for a in self.arms if self.rate(a) >= top)  # the chain wins ties

    def choose(self) -> Optional[int]:
        self.passes += 1
        unmeasured = [a for a in self.arms if self.tries[a] < self.warmup]
        if unmeasured:
            return unmeasured[0]
        if self.passes % self.explore_every == 0:
            return min(self.arms, key=lambda a: self.last[a])
        return self.best()

    def record(self, budget: Optional[int], committed: int, seconds: float, rows: int) -> None:
        """A pass that ran `budget` (CHAIN: the width policy's pass) verifying `rows` rows and committed
        `committed`."""
        if budget not in self.tokens:
            return
        if self.cost is not None:
            seconds = self.cost(rows)
        self.tokens[budget] = self.decay * self.tokens[budget] + committed
        self.seconds[budget] = self.decay * self.seconds[budget] + seconds
        self.tries[budget] += 1
        self.last[budget] = self.passes
