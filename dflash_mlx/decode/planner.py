"""The planner: before each pass, which proposer drafts and how wide the pass is; after it, what it cost.

The loop asks one object one question per pass (`Planner.plan(offers, room)`) and reports one answer
(`Planner.record`). Behind it sit the estimators that make the choice:
- `width.WidthPolicy` (the drafter's widths: measured seconds per width, running per-slot acceptance), a
  `width.FixedWidth` (`width=N`), or any object of the `width.Width` shape (a rank coordinator's wrapper, a test's
  schedule);
- `sources.SourceChoice` when prompt lookup is on: lookup's copied continuation against the drafter's block
  against plain decoding, each at its best width;
- `budget.FixedBudget` / `budget.TreeBudget` when draft trees are on: whether a drafting pass verifies its block
  as a chain or as a tree of up to B nodes (`Plan.budget`).
`cut` applies a drafter's confidence head to the block just drafted (`WidthPolicy.truncate`); whether the planner
may cut is fixed when it is built (a fixed or rank-coordinated width must not change under it), never found out by
looking inside the objects it holds.

`build_planner` is where a generation's options become a planner, in one place for the single stream and the
batch: a fixed width, or an adaptive one up to the drafter's block; sampled output that must follow from its seed
alone gets machine-independent costs (`width.nominal_cost`); then the installed coordinator wraps it. Whether its
passes may be trees is decided there too, once (`with_trees`): nothing that runs the planner turns them off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Union

from ..errors import DFlashError
from ..targets.tree import tree_support
from .budget import FixedBudget, TreeBudget
from .proposal import DFLASH, LOOKUP, PLAIN, Offer
from .proposers import as_proposer
from .sources import SourceChoice
from .width import FixedWidth, Width, WidthPolicy, coordinate, coordinated, nominal_cost


@dataclass
class Plan:
    """The planner's answer for one pass."""

    source: str  # the proposer that drafts it (PLAIN: none)
    width: int  # tokens to verify (1: a plain decoding step)
    offer: Optional[Offer] = None  # the chosen proposer's offer (lookup: the continuation to copy)
    budget: Optional[int] = None  # a tree of up to this many drafted nodes, `width` deep at most (None: a chain)
    chain_width: Optional[int] = None  # with a budget: the width of the chain that verifies where no tree grows
    context: Optional[str] = None  # with trees on "auto": the source the width policy chose for this pass


class Planner:
    """Chooses each pass's proposer and width; see the module docstring.

    Args:
        widths: where pass widths come from (the source choice itself, possibly wrapped, when lookup is on).
        choice: the lookup-vs-drafter choice, when prompt lookup is on.
        cutter: the width policy that may cut a confident block short (None: never cut).
        drafting: whether a proposer may fill widths above 1 (a drafter, not held at width 1).
        drafting_source: that proposer's name (the DFlash drafter's by default).
        trees: chooses, per drafting pass, a chain or a tree budget (`budget.FixedBudget`, `budget.TreeBudget`;
            None: always chains).
        policy: the drafter's width policy, told the acceptance of a tree's first choices (what its chain would
            have drafted) so that it keeps learning while trees replace its chains.
    """

    def __init__(self, widths: Width, *, choice: Optional[SourceChoice] = None,
                 cutter: Optional[WidthPolicy] = None, drafting: bool = True, drafting_source: str = DFLASH,
                 trees=None, policy: Optional[WidthPolicy] = None):
        self.widths, self.choice, self.cutter, self.drafting = widths, choice, cutter, drafting
        self.drafting_source = drafting_source
        self.trees = trees
        self.policy = policy

    def widest(self, source: str) -> int:
        """The widest pass this planner may choose for `source` (what a proposer is asked to offer)."""
        return self.choice.lookup_width if source == LOOKUP and self.choice is not None else 1 << 30

    def plan(self, offers: Dict[str, Optional[Offer]], room: int) -> Plan:
        """The next pass, from the proposers' offers; `room` is the most tokens the generation may still commit."""
        if self.choice is not None:
            self.choice.take(offers.get(LOOKUP), offers.get(self.drafting_source))
        width = int(min(self.widths.choose(), room))
        plan = self._policy_plan(width, room)
        if isinstance(self.trees, TreeBudget) and self._tree_may_replace(plan, room):
            # "auto": a tree instead of the drafter's chain or of plain decoding, where trees were measured faster
            # than that pass in that context (never instead of a lookup copy: a lucky tree must not take a
            # 32-token copy's place). The pass it would replace is worth what the policy expects of its width.
            rates = self.policy.rates_per_second() if self.policy is not None and self.policy.measured() else None
            chain_rate = rates[min(width, len(rates)) - 1] if rates else None
            # Where the policy chose plain decoding the drafter's chains did not pay: only the smallest tree may
            # (its runner-ups near the root), so exploring there costs little when the drafter has collapsed.
            smallest = [min(a for a in self.trees.arms if a is not None)] if plan.source == PLAIN else None
            budget = self.trees.choose(plan.source, chain_rate, smallest)
            if budget is not None:
                return Plan(self.drafting_source, self._deepest(width, room, budget), budget=budget,
                            chain_width=width, context=plan.source)
            return replace(plan, context=plan.source)
        return plan

    def _tree_may_replace(self, plan: Plan, room: int) -> bool:
        """Whether an "auto" tree may stand in for `plan`: the drafter's chain, or plain decoding where a drafter
        could draft (a tree can pay where the drafter's chain would not: its runner-up choices are verified too)."""
        if not any(a is not None for a in self.trees.arms):  # no tree budget to offer
            return False
        if plan.source == self.drafting_source:
            return True
        return plan.source == PLAIN and self.drafting and room > 1 and not isinstance(self.widths, FixedWidth)

    def _policy_plan(self, width: int, room: int) -> Plan:
        """The pass the width policy (and the source choice) chose: plain, a lookup copy or a drafting pass (a
        tree with a fixed budget)."""
        if width <= 1:
            return Plan(PLAIN, 1)
        if self.choice is not None and self.choice.source == LOOKUP:
            copied = self.choice.lookup_tokens[: width - 1]
            # A fixed tree budget lets lookup branch too: the continuations of several earlier occurrences.
            budget = self.trees.budget if isinstance(self.trees, FixedBudget) else None
            return Plan(LOOKUP, len(copied) + 1, Offer(LOOKUP, len(copied) + 1, copied), budget=budget,
                        chain_width=len(copied) + 1)
        # Any other pass wider than 1 is the drafting proposer's (the choice calls it DFLASH); without one, plain.
        if not self.drafting:
            return Plan(PLAIN, 1)
        if isinstance(self.trees, FixedBudget):
            return Plan(self.drafting_source, self._deepest(width, room, self.trees.budget),
                        budget=self.trees.budget, chain_width=width)
        return Plan(self.drafting_source, width)

    def _deepest(self, width: int, room: int, budget: int) -> int:
        """The width of a tree pass's drafted block (root included): as a fixed width allows, else as the drafter's
        block (within `room`), and never more than `budget` + 1, since a tree of `budget` nodes is at most that deep
        (a shorter block also costs the drafter less: it drafts only the positions a node can take)."""
        deepest = width if isinstance(self.widths, FixedWidth) else int(min(1 << 30, room))
        return min(deepest, budget + 1)

    @property
    def cuts(self) -> bool:
        return self.cutter is not None

    def cut(self, confidence: Sequence[float], width: int) -> int:
        """The width of a drafted block of `width` tokens under its confidence estimates (see `cutter`)."""
        return self.cutter.truncate(confidence, width)

    def record(self, width: int, accepted: int, seconds: float, source: Optional[str] = None,
               budget: Optional[int] = None, context: Optional[str] = None, chain=None,
               path: Optional[Sequence[int]] = None) -> None:
        """One finished pass: its width (rows verified), drafts accepted and seconds since the previous pass
        ended; `source` its proposer, `budget` its tree budget (None: a chain), `context` its plan's; a tree's
        `chain`: (width, accepted) of its first choices, the chain it stood in for, and `path` its accepted nodes
        (what smaller trees would have committed)."""
        if budget is not None and chain is not None and self.policy is not None:
            self.policy.observe(*chain)
        if budget is None or source == LOOKUP:  # a lookup tree is still lookup's pass for the source choice
            self.widths.record(width, accepted, seconds)
        if isinstance(self.trees, TreeBudget) and context is not None:  # (None: a pass planned elsewhere)
            self.trees.record(budget if source == self.drafting_source else None, accepted + 1, seconds, width,
                              context, path)


def build_planner(*, drafting=None, width: Optional[int] = None, policy: Optional[Width] = None,
                  max_width: Optional[int] = None, lookup: bool = False, lookup_width: int = 32,
                  reproducible: bool = False,
                  shared: Optional[Callable[[int], Optional["Planner"]]] = None,
                  tree_budget: Union[int, str, None] = None, target=None, cache: Optional[Sequence[Any]] = None,
                  acceptor=None) -> Planner:
    """A generation's planner.

    Args:
        drafting: the proposer that fills passes wider than 1 (`proposers.Proposer`: its `name` and `widest`, the
            drafter's trained block for DFlash), or None: none.
        width: a fixed verify width (1: plain decoding); policy: a ready width policy instead of the adaptive one.
        max_width: the widest adaptive pass (default: the drafting proposer's widest).
        lookup: draft by prompt lookup too (with an adaptive width); lookup_width: its widest pass.
        reproducible: sampled output must follow from the seed alone: widths follow acceptance, not the clock.
        shared: a batch's shared DFlash planner for a widest width (None: none), used by members that may share
            one (no lookup, no seeded sampling).
        tree_budget: drafting passes verify a tree of up to this many drafted nodes (an int), or the planner
            chooses chain or tree budget by measured speed ("auto"); None: chains.
        target, cache, acceptor: the generation's target, its target cache and acceptance rule: trees only where
            they can run (`with_trees`).
    """
    trees = tree_chooser(tree_budget, reproducible)  # a bad value is refused first, whatever else is given
    planner = _width_planner(drafting=drafting, width=width, policy=policy, max_width=max_width, lookup=lookup,
                             lookup_width=lookup_width, reproducible=reproducible,
                             shared=None if tree_budget is not None else shared)
    return with_trees(planner, trees, drafting=drafting, target=target, cache=cache, acceptor=acceptor)


def with_trees(planner: Planner, trees, *, drafting=None, target=None, cache: Optional[Sequence[Any]] = None,
               acceptor=None) -> Planner:
    """`planner` with the tree budget estimator `trees` (see `tree_chooser`) where its trees can run: it drafts at
    all; `target` can verify trees on `cache` (`targets.tree.tree_support`; None: not asked); and the `drafting`
    proposer grows them under `acceptor` (`Proposer.grows_trees`; without one, lookup's copies branch). The one
    place that decides: a FIXED budget the target cannot take is told why, in one warning ("auto" means trees where
    they can run, so chains are what it chooses there). Trees are this planner's own (a batch's shared planner
    never gets them)."""
    if trees is None or not (planner.drafting or planner.choice is not None):
        return planner
    why = tree_support(target, cache) if target is not None else None
    if why is not None and isinstance(trees, FixedBudget):
        warnings.warn(f"draft trees are off for this target ({why}); verifying chains", stacklevel=3)
    grows = drafting is None or as_proposer(drafting).grows_trees(acceptor)
    planner.trees = trees if why is None and grows else None
    return planner


def tree_chooser(tree_budget: Union[int, str, None], reproducible: bool = False):
    """The budget estimator for a `tree_budget` option: `FixedBudget(B)`, for "auto" a `TreeBudget`, for None
    none; anything else is refused in one line."""
    if tree_budget is None:
        return None
    if tree_budget == "auto":
        # Ranks of one distributed generation must choose alike, and their clocks differ: with a coordinator
        # installed the arms are compared on the fixed cost model, which every rank computes the same.
        return TreeBudget(cost=nominal_cost if reproducible or coordinated() else None)
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise DFlashError(f"tree_budget must be a number of nodes >= 1, 'auto' or None, got {tree_budget!r}")
    return FixedBudget(tree_budget)


def _width_planner(*, drafting, width, policy, max_width, lookup, lookup_width, reproducible, shared) -> Planner:
    source = drafting.name if drafting is not None else DFLASH
    if width is not None and drafting is not None and width < 1:
        raise DFlashError(f"width must be >= 1 (1: plain decoding), got {width}")
    if width is not None or (drafting is None and not lookup):
        fixed = width if width is not None and drafting is not None else 1
        return Planner(FixedWidth(fixed), drafting=fixed > 1, drafting_source=source)
    if policy is not None:
        return Planner(policy, cutter=policy if isinstance(policy, WidthPolicy) else None,
                       drafting=drafting is not None, drafting_source=source)
    cost = nominal_cost if reproducible else None
    widest = max_width or (drafting.widest if drafting is not None else None)
    pooled = (shared(widest) if shared is not None and source == DFLASH and not lookup and not reproducible
              else None)
    if pooled is not None:
        return pooled
    model = WidthPolicy(widest, cost=cost) if drafting is not None else None
    if lookup:
        choice = SourceChoice(model, lookup_width, cost=cost)
        paced, cutter = pace(choice, model)
        return Planner(paced, choice=choice, cutter=cutter, drafting=drafting is not None, drafting_source=source,
                       policy=model)
    paced, cutter = pace(model, model)
    return Planner(paced, cutter=cutter, drafting_source=source, policy=model)


def pace(widths: Width, model: Optional[WidthPolicy]):
    """(`widths` as the installed rank coordinator wraps it, the policy that may cut a confident block: `model`,
    unless the coordinator wrapped it, since ranks must choose alike)."""
    paced = coordinate(widths)
    return paced, (model if paced is widths else None)


def check_width(width, caller: str) -> None:
    """Refuse a `width` that is not a number of tokens (a width policy goes to `planner=`)."""
    if width is not None and (isinstance(width, bool) or not isinstance(width, int)):
        raise DFlashError(f"{caller}(width={width!r}): width is the tokens verified per pass (an int); "
                          "give a width policy or planner as planner=")


def planner_for(drafting, *, width: Optional[int] = None, planner=None, sources: Optional[SourceChoice] = None,
                lookup=None, tree_budget=None, reproducible: bool = False, target=None,
                cache: Optional[Sequence[Any]] = None, acceptor=None) -> Planner:
    """`_planner_for` with draft trees on where `tree_budget` (or a ready planner) says and they can run (see
    `with_trees`)."""
    trees = tree_chooser(tree_budget, reproducible)  # a bad value is refused first, whatever else is given
    planner = _planner_for(drafting, width=width, planner=planner, sources=sources, lookup=lookup)
    # A ready planner's own trees are held against this target and cache too.
    return with_trees(planner, trees if trees is not None else planner.trees, drafting=drafting, target=target,
                      cache=cache, acceptor=acceptor)


def _planner_for(drafting, *, width: Optional[int] = None, planner=None, sources: Optional[SourceChoice] = None,
                 lookup=None) -> Planner:
    """The planner for the loop's and the batch's arguments (`drafting`: the proposer of passes wider than 1, or
    None): a fixed `width`, a ready `planner` or a width policy object there, or a `sources` choice with its
    `lookup` index. A fixed width wins over any planner or policy."""
    check_width(width, "dflash_generate_step")
    if width is not None:
        return build_planner(drafting=drafting, width=width)
    if isinstance(planner, Planner):
        return planner
    policy = planner  # a width policy object (or None)
    if sources is not None:
        if lookup is None:
            raise DFlashError("a draft-source choice needs a lookup index")
        paced = policy or sources
        cut_by = paced.dflash if isinstance(paced, SourceChoice) else paced
        cutter = cut_by if isinstance(cut_by, WidthPolicy) else None
        return Planner(paced, choice=sources, cutter=cutter, drafting=drafting is not None,
                       drafting_source=drafting.name if drafting is not None else DFLASH)
    if policy is not None:
        return build_planner(drafting=drafting, policy=policy)
    return build_planner(drafting=drafting, width=drafting.widest if drafting is not None else 1)
