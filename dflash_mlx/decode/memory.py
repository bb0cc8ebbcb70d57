"""What decoding has measured, kept from one generation to the next: a planner that remembers.

A generation's planner learns as it goes: the seconds a pass costs at each verify width and tree budget on this
machine, and how often each source's drafts are accepted (the drafter's per slot, lookup's per match length). A
fresh planner knows none of it, so it probes: a wide first pass, every tree budget once, lookup against the
drafter. A short reply (a coding agent's tool call is often a few dozen tokens) pays those probes and can end up
slower than plain decoding.

`PlannerMemory` keeps what the last generation learnt and seeds the next one with it. The server keeps one per
process (every request starts where the previous one left off), a chat session one per conversation (a turn
continues the last). What is kept are the estimators' running sums. Costs are facts of the machine and are carried
as they are; acceptance is a fact of the text, which changes from one request to the next, so it is carried as
its mean with the weight of a few passes (`CARRIED_PASSES`): a request unlike the last moves it at once.

Runs that must follow from their seed alone (seeded sampling: widths by acceptance, not by the clock) are neither
seeded nor kept: their choices may not depend on what ran before them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Dict, List, Optional, Tuple

from .budget import TreeBudget
from .sources import SourceChoice
from .width import WidthPolicy

# The learnt state of each estimator (what `seed` copies); the rest is configuration or the pass in flight. A
# width policy's probe savings are not carried: a new request saves up for its own probes before it makes any.
_WIDTH_STATE = ("hits", "trials", "costs", "samples", "cycles")
_SOURCE_STATE = ("pooled", "by_match")
_TREE_STATE = ("contexts",)


CARRIED_PASSES = 8.0  # the weight, in passes, that carried acceptance counts have in the next generation


def _lighter(hits: List[float], trials: List[float]) -> Tuple[List[float], List[float]]:
    """Acceptance counts with their ratios kept and their weight cut to `CARRIED_PASSES` observations (slot 1's)."""
    heaviest = max(trials[1:] or [0.0])
    scale = min(1.0, CARRIED_PASSES / heaviest) if heaviest > 0 else 1.0
    return [h * scale for h in hits], [t * scale for t in trials]


def _carry(name: str, value: Any) -> Any:
    """What of an estimator's learnt field a new generation starts from (see the module docstring)."""
    if name == "by_match":
        return {k: _carry("counts", v) for k, v in value.items()}
    if name in ("pooled", "counts"):
        value.hits, value.trials = _lighter(value.hits, value.trials)
    elif name == "contexts":  # tree arms: each arm's tokens and seconds keep their means at a few passes' weight
        for arms in value.values():
            for arm in arms.arms:
                for total, weight in (("tokens", "samples"), ("seconds", "runs")):
                    w = getattr(arms, weight)[arm]
                    if w > CARRIED_PASSES:
                        getattr(arms, total)[arm] *= CARRIED_PASSES / w
                        getattr(arms, weight)[arm] = CARRIED_PASSES
    return value


def _estimators(planner) -> List[Tuple[str, Any]]:
    """(kind, estimator) of each learning part of `planner` that a memory may seed and keep."""
    found = []
    policy = getattr(planner, "policy", None)
    if isinstance(policy, WidthPolicy) and policy.fixed_cost is None:
        found.append(("width", policy))
    choice = getattr(planner, "choice", None)
    if isinstance(choice, SourceChoice) and choice.costs.fixed_cost is None:
        found.append(("sources", choice))
        found.append(("lookup-costs", choice.costs))
    trees = getattr(planner, "trees", None)
    if isinstance(trees, TreeBudget) and trees.cost is None:
        found.append(("trees", trees))
    return found


def _shape(estimator: Any) -> Tuple:
    """What must match for one estimator's state to fit another (widths, lookup width, tree arms)."""
    if isinstance(estimator, WidthPolicy):
        return ("width", estimator.max_width)
    if isinstance(estimator, SourceChoice):
        return ("sources", estimator.lookup_width)
    return ("trees", tuple(estimator.arms))


def _fields(estimator: Any) -> Tuple[str, ...]:
    if isinstance(estimator, WidthPolicy):
        return _WIDTH_STATE
    if isinstance(estimator, SourceChoice):
        return _SOURCE_STATE
    return _TREE_STATE


class PlannerMemory:
    """The measurements of the generations run so far, for the next one; see the module docstring."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: Dict[str, Tuple[Tuple, Dict[str, Any]]] = {}  # kind -> (shape, learnt state)
        self.generations = 0  # generations whose measurements were kept

    def __bool__(self) -> bool:
        return bool(self._kept)

    def seed(self, planner) -> bool:
        """Give `planner`'s estimators what the earlier generations learnt (where their shapes fit); whether any
        was seeded."""
        seeded = False
        with self._lock:
            for kind, estimator in _estimators(planner):
                shape, state = self._kept.get(kind, (None, None))
                if state is None or shape != _shape(estimator):
                    continue
                state = copy.deepcopy(state)
                if isinstance(estimator, WidthPolicy):
                    state["hits"], state["trials"] = _lighter(state["hits"], state["trials"])
                for name, value in state.items():
                    setattr(estimator, name, _carry(name, value))
                seeded = True
        return seeded

    def keep(self, planner) -> None:
        """Remember what `planner`'s estimators learnt (the generation has ended)."""
        found = _estimators(planner)
        if not found:
            return
        with self._lock:
            for kind, estimator in found:
                state = {name: copy.deepcopy(getattr(estimator, name)) for name in _fields(estimator)}
                self._kept[kind] = (_shape(estimator), state)
            self.generations += 1

    def forget(self) -> None:
        with self._lock:
            self._kept.clear()
            self.generations = 0

    def summary(self) -> Optional[Dict[str, Any]]:
        """What is remembered, for metrics and logs: the measured seconds per verify width, or None."""
        with self._lock:
            shape, state = self._kept.get("width", (None, None))
            if state is None:
                return None
            return {"generations": self.generations,
                    "seconds_per_width": {str(w): round(c, 6) for w, (c, _) in sorted(state["costs"].items())}}
