"""The verify width of each cycle: the width that maximizes expected committed tokens per second.

Before each cycle the engine asks `WidthPolicy.choose()` for a width w (1 = plain decoding, no drafting; at most
the drafter's block size); after the cycle's one host sync it reports `record(w, accepted, seconds)`. The choice
is `argmax_w E(w) / c(w)` over two running estimates:

- c(w), seconds per cycle at width w (draft + verify + host), measured on the running machine from the time
  between the engine's consecutive syncs (no extra sync): the median of the width's last few cycles, so a cycle
  slowed by a neighbour's burst of work does not move it, and never more than a wider width's (a wider cycle
  does more work). Unmeasured widths are interpolated
  between measured ones, extrapolated flat above the widest (so wider widths get tried) and, for plain decoding,
  guessed as a fraction of the cheapest drafting cycle until it is measured. Measurements expire after `expire`
  cycles, so the model follows the cost growth of a longer context.
- a_i, the probability that draft slot i is accepted given that slots 1..i-1 were, from counts that fade with
  every cycle (old evidence loses weight even while a slot is not drafted), shrunk toward a_{i-1} where slot i
  has little data. E(w) = 1 + sum_{i<w} prod_{j<=i} a_j.

Probes: while the choice is narrower than the block, slots beyond it get no data. A probe cycle at twice the
chosen width runs whenever the time saved up for probes (`probe_budget` of all cycle time) pays for its extra
cost, so acceptance that improves is noticed at a bounded price when it does not. A probe that gets drafts
accepted pays for the next one right away, so the width grows back within a few cycles. A narrower width whose
estimated rate is close to the best is re-measured the same way, so a cost measured in a busy moment does not
keep the choice wrong.
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple


class Width(Protocol):
    """What the engine asks of a width choice."""

    def choose(self) -> int: ...

    def record(self, width: int, accepted: int, seconds: float) -> None: ...


# How a width policy is shared with other processes that must choose the same widths (ranks of one
# distributed generation). The core has no notion of ranks: the distributed layer installs a wrapper when it joins
# a group of several; alone, a policy is used as it is.
_coordinator: Optional[Callable[["Width"], "Width"]] = None


def install_coordinator(wrap: Optional[Callable[["Width"], "Width"]]) -> None:
    """Have every adaptive width policy built from now on wrapped by `wrap` (None: no wrapping)."""
    global _coordinator
    _coordinator = wrap


def coordinated() -> bool:
    """Whether a coordinator is installed (this process is one rank of several that must choose alike)."""
    return _coordinator is not None


def coordinate(policy: "Width") -> "Width":
    """`policy` as the installed coordinator wraps it (itself when none is installed)."""
    return _coordinator(policy) if _coordinator is not None else policy


class FixedWidth:
    """Always the same width (`width=N`, `--width N`)."""

    def __init__(self, width: int):
        self.width = width

    def choose(self) -> int:
        return self.width

    def record(self, width: int, accepted: int, seconds: float) -> None:
        pass


def expected_tokens(rates: Sequence[float]) -> List[float]:
    """E(w) for w = 1..len(rates)+1 (index w-1) from per-slot acceptance: 1 + sum_{i<w} prod_{j<=i} a_j."""
    expected, run = [1.0], 1.0
    for a in rates:
        run *= a
        expected.append(expected[-1] + run)
    return expected


def nominal_cost(width: int) -> float:
    """A machine-independent cycle cost (in decode steps) for reproducible runs: drafting costs a fifth of a
    step and each verified token a twentieth, about what a memory-bound GPU shows."""
    return 1.0 if width == 1 else 1.2 + 0.05 * (width - 1)


class WidthPolicy:
    """Adaptive verify width; see the module docstring.

    Args:
        max_width: the drafter's block size (the widest block it drafts).
        first_width: the width of the first cycle, before anything is measured (default: `max_width`; a good
            drafter then loses no cycle, a useless one pays for one wide cycle).
        decay: weight kept by acceptance counts from one cycle to the next (memory ~ 1/(1-decay) cycles).
        prior: acceptance assumed for slot 1 before any data; `prior_weight` is its weight in observations.
        window: cycle times per width whose median is its cost.
        plain_guess: c(1) / c(cheapest measured width) assumed until plain decoding is measured.
        probe_budget: fraction of decoding time that probes may cost beyond the chosen width's cycles.
        probe_gap: fewest cycles between two probes paid from the budget. Where drafting is nearly free (a
            memory-bound CPU verifies 2-4 tokens for the price of one) a probe looks cheap, yet each one still
            loses its extra cost; spacing them bounds that loss whatever the estimates say.
        expire: cycles after which a width's cost measurement is dropped.
        cost: a fixed cost per width used instead of the measured seconds (e.g. `nominal_cost`): the choices then
            depend on acceptance alone, so a seeded sampling run reproduces whatever the machine's speed.
    """

    def __init__(self, max_width: int, *, first_width: Optional[int] = None, decay: float = 0.98, prior: float = 0.5,
                 prior_weight: float = 0.5, window: int = 5, plain_guess: float = 0.6,
                 probe_budget: float = 0.03, probe_gap: int = 8, expire: int = 512, cost: Optional[Callable[[int], float]] = None):
        if max_width < 1:
            raise ValueError(f"max_width must be >= 1, got {max_width}")
        self.max_width = max_width
        self.first_width = max(1, min(first_width or max_width, max_width))
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        self.window, self.plain_guess = window, plain_guess
        self.probe_budget, self.expire = probe_budget, expire
        self.fixed_cost = cost
        self.hits = [0.0] * max_width  # index i: slot i (1..max_width-1); index 0 unused
        self.trials = [0.0] * max_width
        self.costs: Dict[int, Tuple[float, int]] = {}  # width -> (seconds per cycle, cycle index measured)
        self.samples: Dict[int, List[float]] = {}  # width -> its last `window` cycle times
        self.cycles = 0
        self.savings = 0.0  # seconds saved up for probes
        self.probe: Optional[int] = None  # width of the probe in flight
        self.funded = False  # the last probe had drafts accepted: probe again now
        self.probe_gap = probe_gap
        self.last_probe = -probe_gap  # cycle index of the last budget-paid probe

    # -- estimates -----------------------------------------------------------------------------------------------
    def acceptance(self) -> List[float]:
        """a_1 .. a_{max_width-1}: acceptance of each slot given the slots before it were accepted."""
        rates, previous = [], self.prior
        for i in range(1, self.max_width):
            previous = (self.hits[i] + self.prior_weight * previous) / (self.trials[i] + self.prior_weight)
            rates.append(previous)
        return rates

    def expected_tokens(self, rates: Optional[List[float]] = None) -> List[float]:
        """E(w) for w = 1..max_width (index w-1): tokens a cycle of width w commits on average."""
        return expected_tokens(self.acceptance() if rates is None else rates)

    def measured(self) -> bool:
        """Whether any width's cost has been measured yet."""
        return bool(self.costs)

    def measured_widths(self) -> List[int]:
        """The widths whose cost is measured now."""
        return sorted(self.costs)

    def cost(self, width: int) -> Optional[float]:
        """Estimated seconds of a cycle at `width` (None before any measurement)."""
        measured = sorted((w, c) for w, (c, _) in self.costs.items())
        if not measured:
            return None
        # A wider cycle never costs less than a narrower one (more rows to verify; width 1 does not draft), so a
        # narrower width's cost is capped by every wider one's: a slow moment measured while a width was in use
        # cannot keep it looking dear after the machine calms down.
        for i in range(len(measured) - 2, -1, -1):
            measured[i] = (measured[i][0], min(measured[i][1], measured[i + 1][1]))
        table = dict(measured)
        if width in table:
            return table[width]
        drafting = [(w, c) for w, c in measured if w > 1]
        if width == 1:
            return self.plain_guess * min(c for _, c in drafting)
        if not drafting:
            return table[1]
        below = [(w, c) for w, c in drafting if w < width] or [(1, table.get(1, drafting[0][1]))]
        above = [(w, c) for w, c in drafting if w > width]
        if not above:
            return below[-1][1]  # flat above the widest measured width: optimistic, so it gets tried
        (w0, c0), (w1, c1) = below[-1], above[0]
        return c0 + (c1 - c0) * (width - w0) / (w1 - w0)

    def rates_per_second(self) -> List[float]:
        """E(w) / c(w) for w = 1..max_width (index w-1)."""
        expected = self.expected_tokens()
        return [expected[w - 1] / max(self.cost(w), 1e-9) for w in range(1, self.max_width + 1)]

    def best(self) -> int:
        rates = self.rates_per_second()
        top = max(rates)
        return next(w for w in range(1, self.max_width + 1) if rates[w - 1] >= 0.99 * top)  # narrowest near-best

    def truncate(self, confidence: Sequence[float], widest: int) -> int:
        """The width of a pass whose block of `widest` tokens (the width `choose` gave) a drafter with a confidence
        head has drafted: `confidence[i-1]` is the head's estimate that draft i is accepted given drafts 1..i-1
        were. Draft 1 is always verified (drafting was paid for); then slot by slot, slot i is verified while some
        wider width, under the head's estimates up to slot i and the running ones beyond, commits more tokens per
        second than stopping before it. Each decision reads the head's values up to its slot only, and those
        depend only on the drafts before it (never on the slot's own draw): the cut is a stopping time, so
        sampling stays exact.
        """
        widest = min(widest, self.max_width, len(confidence) + 1)
        if not self.costs or widest <= 2:
            return widest
        running, width = self.acceptance(), 2
        costs = [max(self.cost(v), 1e-9) for v in range(1, widest + 1)]  # the same for every slot's decision
        for i in range(2, widest):
            expected = self.expected_tokens(list(confidence[:i]) + running[i: widest - 1])
            rate = [e / c for e, c in zip(expected, costs)]
            if max(rate[i:]) <= rate[i - 1]:  # nothing wider than i beats stopping before slot i
                break
            width = i + 1
        return width

    # -- the two calls the engine makes ------------------------------------------------------------------------
    def choose(self) -> int:
        if not self.costs or self.max_width == 1:
            return self.first_width
        width = self.best()
        up = min(self.max_width, max(2, 2 * width))
        self.probe = None
        if up > width and self.funded:
            self.probe, self.funded = up, False
            return up
        # Upward probes are spaced by `probe_gap`; re-measuring a close narrower width is not (it is the way back
        # to a cheaper choice whose cost was measured in a slow moment).
        spaced = self.cycles - self.last_probe >= self.probe_gap
        for probe in (up if spaced else None, self._close_narrower(width)):
            if probe is not None and probe != width and self.savings >= self.probe_cost(probe, width):
                self.savings -= max(self.probe_cost(probe, width), 0.0)
                self.probe, self.last_probe = probe, self.cycles
                return probe
        return width

    def probe_cost(self, probe: int, width: int) -> float:
        """Seconds a cycle at `probe` loses against the same tokens committed at `width`'s rate."""
        expected = self.expected_tokens()
        return self.cost(probe) - expected[probe - 1] * self.cost(width) / expected[width - 1]

    def _close_narrower(self, width: int) -> Optional[int]:
        """Half the width, when its estimated rate is within 20% of the best: its cost may be stale (it is only
        measured while in use), so it is re-measured now and then."""
        narrower = max(1, width // 2)
        rates = self.rates_per_second()
        return narrower if narrower < width and rates[narrower - 1] >= 0.8 * rates[width - 1] else None

    def record(self, width: int, accepted: int, seconds: float) -> None:
        """One finished cycle: `accepted` drafts of a `width`-token block, `seconds` since the previous sync."""
        if self.fixed_cost is not None:
            seconds = self.fixed_cost(width)
        self.cycles += 1
        # Savings are capped at one widest cycle, so a long wide stretch does not buy a burst of probes later.
        self.savings = min(self.savings + self.probe_budget * seconds, self.cost(self.max_width) or seconds)
        old = self.costs.get(width)
        if old is None or self.cycles - old[1] > self.expire:
            self.samples[width] = []
        recent = self.samples[width] = (self.samples[width] + [seconds])[-self.window:]
        self.costs[width] = (statistics.median(recent), self.cycles)
        self.costs = {w: v for w, v in self.costs.items() if self.cycles - v[1] <= self.expire}
        self.funded = self.probe == width and accepted > 0
        self.observe(width, accepted)

    def observe(self, width: int, accepted: int) -> None:
        """Acceptance alone, without a cost: `accepted` drafts of a `width`-token chain (e.g. the first choices of
        a draft tree, which is what a chain would have drafted)."""
        self.trials = [self.decay * t for t in self.trials]
        self.hits = [self.decay * h for h in self.hits]
        # Slots 1..accepted were accepted; slot accepted+1 (if drafted) was the first rejection.
        for i in range(1, min(accepted + 1, width - 1) + 1):
            self.trials[i] += 1.0
            self.hits[i] += 1.0 if i <= accepted else 0.0
