"""Tree budgets: whether a drafting pass verifies the drafter's block as a chain or as a DDTree of up to B nodes.

A tree spends verify rows on the drafter's second and third choices where its first is unsure; whether that pays
depends on the machine (a memory-bound GPU verifies 8 rows for little more than 1; this CPU pays per row) and on
the drafter.

- `FixedBudget(B)`: every drafting pass is a tree of up to B nodes (`tree_budget=B`); the width policy still
  decides which passes draft.
- `TreeBudget` (`tree_budget="auto"`): where the width policy chose a drafter's chain or plain decoding, that
  pass (the arm `CHAIN`) or a tree of one of a few budgets, by measured committed tokens per second (each arm's
  tokens and seconds summed with a fading weight, kept per context: the kind of pass the policy chose). Every arm
  is tried first; afterwards the arm tried least recently is re-measured once every `explore_every` passes, so the
  choice follows a drafter whose acceptance changes at a bounded price (at most one pass in `explore_every` runs a
  worse arm). The planner never lets a tree replace a lookup copy, and where the policy chose plain decoding
  (the drafter's chains did not pay) it offers only the smallest tree.

The default budgets, 3, 7 and 15 nodes, verify 4, 8 and 16 rows: the row counts the verify matmuls run fastest at
(on this CPU a 5-row pass costs more than a 4-row one; Apple GPUs' verify kernel takes up to 16 rows).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Union

CHAIN = None  # the arm that runs the width policy's own pass (no tree)


DEFAULT_TREES = "default"  # what the front ends pass when the user chose nothing (see `default_trees`)


def default_trees(tree_budget: Union[int, str, None], width: Optional[int], seed: Optional[int] = None,
                  planner: object = None) -> Union[int, str, None]:
    """A front end's `tree_budget` with DEFAULT_TREES resolved: "auto" (chain or tree by measured speed) where the
    width is chosen per pass; chains where the caller fixed the width (every pass then verifies that many rows),
    brought a planner of its own (it chooses the passes), or gave a seed (a seed then gives the same text in every
    front end, the server's batched chains included)."""
    if tree_budget != DEFAULT_TREES:
        return tree_budget
    return "auto" if width is None and seed is None and planner is None else None


class FixedBudget:
    """Always a tree of up to `budget` nodes."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {budget}")
        self.budget = budget


class _Arms:
    """The measurements of one context: per arm, fading sums of committed tokens (with their weight) and of seconds
    (with theirs), tries, last use. Tokens and seconds are kept apart because an arm's tokens are also learnt from
    a larger tree's pass (what its first nodes would have committed), its seconds only from its own passes."""

    def __init__(self, arms):
        self.arms = list(arms)
        self.tokens: Dict[Optional[int], float] = {a: 0.0 for a in arms}
        self.samples: Dict[Optional[int], float] = {a: 0.0 for a in arms}
        self.seconds: Dict[Optional[int], float] = {a: 0.0 for a in arms}
        self.runs: Dict[Optional[int], float] = {a: 0.0 for a in arms}
        self.tries: Dict[Optional[int], int] = {a: 0 for a in arms}
        self.last: Dict[Optional[int], int] = {a: -1 for a in arms}
        self.passes = 0

    def rate(self, arm: Optional[int]) -> float:
        """Committed tokens per second of `arm` so far (0 before it ran): mean tokens over mean seconds."""
        if self.seconds[arm] <= 0 or self.samples[arm] <= 0:
            return 0.0
        return (self.tokens[arm] / self.samples[arm]) / (self.seconds[arm] / self.runs[arm])

    def add_tokens(self, arm: Optional[int], committed: float, decay: float) -> None:
        self.tokens[arm] = decay * self.tokens[arm] + committed
        self.samples[arm] = decay * self.samples[arm] + 1.0


class TreeBudget:
    """Tree or the width policy's own pass, by measured tokens per second; see the module docstring.

    The measurements are kept per context: what the width policy chose for the pass (plain decoding, a drafter's
    chain). A tree that pays where the policy would decode plainly need not pay where it would draft a chain, so
    each is compared with what it would replace.

    Args:
        budgets: the tree budgets to choose among (besides the policy's pass, `CHAIN`).
        warmup: passes each arm runs (per context) before the rates are compared.
        explore_every: passes (per context) between two re-measurements of the arm tried least recently.
        decay: weight kept by an arm's sums from one of its passes to the next.
        cost: seconds of a pass by its verified rows, used instead of the clock (seeded sampling: the choices then
            follow acceptance alone, so a seed reproduces a run on any machine).
    """

    def __init__(self, budgets: Sequence[int] = (3, 7, 15), *, warmup: int = 1, explore_every: int = 32,
                 decay: float = 0.9, cost: Optional[Callable[[int], float]] = None):
        self.arms = [CHAIN] + sorted(set(int(b) for b in budgets if b >= 1))
        self.warmup, self.explore_every, self.decay, self.cost = warmup, explore_every, decay, cost
        self.contexts: Dict[Optional[str], _Arms] = {}

    def _of(self, context: Optional[str], budgets: Optional[Sequence[int]] = None) -> _Arms:
        if context not in self.contexts:
            chosen = [a for a in self.arms if a is CHAIN or budgets is None or a in budgets]
            self.contexts[context] = _Arms(chosen)
        return self.contexts[context]

    def best(self, context: Optional[str] = None, chain_rate: Optional[float] = None) -> Optional[int]:
        """The fastest arm; `chain_rate`: the width policy's own estimate for the chain it chose (tokens per
        second at that width), used for `CHAIN` instead of the rate measured over all its chains."""
        arms = self._of(context)
        rates = {a: arms.rate(a) for a in arms.arms}
        if chain_rate is not None:
            rates[CHAIN] = chain_rate
        top = max(rates.values())
        return next(a for a in arms.arms if rates[a] >= top)  # the policy's pass wins ties

    def choose(self, context: Optional[str] = None, chain_rate: Optional[float] = None,
               budgets: Optional[Sequence[int]] = None) -> Optional[int]:
        """The arm for the next pass, where the width policy chose a pass of kind `context` (its estimated rate
        `chain_rate`, where it has one); `budgets`: the tree budgets this context may try (default: all), fixed
        the first time the context is seen."""
        arms = self._of(context, budgets)
        arms.passes += 1
        unmeasured = [a for a in arms.arms if arms.tries[a] < self.warmup]
        if unmeasured:
            return unmeasured[0]
        if arms.passes % self.explore_every == 0:
            return min(arms.arms, key=lambda a: arms.last[a])
        return self.best(context, chain_rate)

    def record(self, budget: Optional[int], committed: int, seconds: float, rows: int,
               context: Optional[str] = None, path: Optional[Sequence[int]] = None) -> None:
        """A pass that ran `budget` (CHAIN: the width policy's pass) in `context`, verifying `rows` rows and
        committing `committed` tokens. A tree's `path` (its accepted nodes, root excluded, as tree slots in the
        order DDTree kept them) also tells every smaller budget what it would have committed: the tree of b nodes
        is this tree's first b, so its accepted path is the prefix of `path` within them (exact for greedy
        verification, and the block drafted for a smaller tree is shorter: close, which is all a speed estimate
        needs)."""
        arms = self._of(context)
        if budget not in arms.tokens:
            return
        if self.cost is not None:
            seconds = self.cost(rows)
        arms.add_tokens(budget, committed, self.decay)
        arms.seconds[budget] = self.decay * arms.seconds[budget] + seconds
        arms.runs[budget] = self.decay * arms.runs[budget] + 1.0
        arms.tries[budget] += 1
        arms.last[budget] = arms.passes
        if budget is not CHAIN and path is not None:
            for smaller in arms.arms:
                if smaller is not CHAIN and smaller < budget:
                    kept = next((i for i, slot in enumerate(path) if slot > smaller), len(path))
                    arms.add_tokens(smaller, min(committed, kept + 1), self.decay)
