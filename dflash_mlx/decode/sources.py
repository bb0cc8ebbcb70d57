"""The draft source and verify width of each pass: {DFlash block, lookup continuation, none} x width.

`width.WidthPolicy` chooses the width of DFlash passes by expected committed tokens per second. `SourceChoice`
extends that choice to where the draft comes from; it is the estimator behind `planner.Planner` when prompt lookup
is on. Before each pass the planner hands it the proposers' offers (`take`): a lookup continuation (copied from
the context by `proposers.lookup.LookupProposer`) and, when there is a drafter, a DFlash block. For each source s and width w it estimates the rate E_s(w) / c_s(w) and takes the best:

- E_s(w) = 1 + sum_{i<w} prod_{j<=i} a_j, from per-slot acceptance a_j (slot j accepted given 1..j-1 were). The
  DFlash source keeps `WidthPolicy`'s own estimates, unless per-slot probabilities are supplied for the pass
  (the drafting proposer's `Offer.rates`; a lookup `Offer.rates` likewise). A drafter's confidence head (DSpark's
  `DSparkWalk.confidence()`) is known only after its block is drafted, so it acts then instead: the DFlash width
  policy cuts the drafted block on it (`WidthPolicy.truncate`, applied by the planner, `planner.Planner.cut`).
  Lookup keeps faded counts per match length (a short match is a guess, a long one usually a copy in progress),
  each shrunk toward the pooled lookup counts, those toward a prior that grows with the match length.
- c_s(w): measured seconds per pass, from the time between the loop's syncs, per source (a lookup pass is a
  verify pass without the drafter's forward, so it is cheaper than a DFlash pass of the same width). Plain decoding
  (w = 1) is one cost shared by both. A lookup width not yet measured costs a plain step plus its extra rows at the
  median per-row cost of the measured widths (a lookup pass of width 1 is a plain step); before any is measured,
  a plain step's, so lookup gets tried.

A lookup offer that loses is not tried: its acceptance estimate only fades back toward the prior, so a match
length that failed is retried after a while rather than every pass. With no drafter, the choice is lookup or
plain decoding. Every choice commits only the target's own tokens, so any sequence of choices is lossless.

`SourceChoice` has the `width.Width` shape (`choose()`, `record(width, accepted, seconds)`), so the distributed
layer's coordinator can wrap it like a width policy; the planner hands it the pass's offers first (`take`) and
reads the chosen source after (`source`, and `lookup_tokens` for a copy).
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional

from .lookup import LookupDraft
from .proposal import DFLASH, LOOKUP, PLAIN, Offer
from .width import WidthPolicy, expected_tokens

# Match lengths are pooled into these buckets (a bucket is the largest bound <= the match length).
MATCH_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)


def match_bucket(match: int) -> int:
    return max([b for b in MATCH_BUCKETS if b <= match] or [MATCH_BUCKETS[0]])


class _SlotCounts:
    """Faded counts of slot acceptance (slot i accepted given slots before it were), as `WidthPolicy` keeps."""

    def __init__(self, slots: int):
        self.hits = [0.0] * (slots + 1)
        self.trials = [0.0] * (slots + 1)

    def fade(self, decay: float) -> None:
        self.trials = [decay * t for t in self.trials]
        self.hits = [decay * h for h in self.hits]

    def add(self, accepted: int, drafted: int) -> None:
        for i in range(1, min(accepted + 1, drafted) + 1):
            self.trials[i] += 1.0
            self.hits[i] += 1.0 if i <= accepted else 0.0

    def rates(self, prior: List[float], weight: float) -> List[float]:
        """Per-slot acceptance, each slot shrunk with `weight` observations toward these counts' acceptance over all
        their slots, that shrunk toward `prior` (same length). A copy that held for every slot a pass checked likely
        holds for the next: the slots that narrow passes never reached are estimated from the ones they did (else a
        loop copied 8 wide, all accepted, would never learn that 16 wide pays)."""
        hits, trials = sum(self.hits[1:]), sum(self.trials[1:])
        overall = [(hits + weight * p) / (trials + weight) for p in prior]
        return [(self.hits[i] + weight * overall[i - 1]) / (self.trials[i] + weight) for i in range(1, len(prior) + 1)]


class SourceChoice:
    """Chooses each pass's draft source and width; see the module docstring.

    Args:
        dflash: the DFlash width policy (it also measures plain decoding), or None without a drafter.
        lookup_width: the widest lookup pass (drafts + 1).
        decay: weight kept by lookup acceptance counts from one pass to the next.
        prior_weight: observations the pooled lookup counts weigh in each match length's estimate (and the prior
            in the pooled counts).
        cost: a fixed cost per width instead of measured seconds (`width.nominal_cost`: reproducible sampling).
    """

    def __init__(self, dflash: Optional[WidthPolicy], lookup_width: int = 32, *, decay: float = 0.98,
                 prior_weight: float = 1.0, cost: Optional[Callable[[int], float]] = None):
        self.dflash = dflash
        self.lookup_width = max(2, lookup_width)
        self.decay, self.prior_weight = decay, prior_weight
        # Lookup pass costs (and plain decoding's when there is no drafter) in a width policy's cost table.
        self.costs = WidthPolicy(self.lookup_width, cost=cost)
        self.pooled = _SlotCounts(self.lookup_width - 1)
        self.by_match: Dict[int, _SlotCounts] = {}
        self._offer: Optional[Offer] = None
        self._dflash_rates: Optional[List[float]] = None
        self.source = PLAIN  # the source of the pass last chosen
        self._chosen: Optional[Offer] = None

    def _dflash_measured(self) -> bool:
        return self.dflash is not None and self.dflash.measured()

    # -- estimates -----------------------------------------------------------------------------------------------
    def lookup_rates(self, match: int, slots: int) -> List[float]:
        """Acceptance of lookup slots 1..slots for a match of this length."""
        slots = min(slots, self.lookup_width - 1)
        # Prior: a continuation after m matching tokens is right about m/(m+2) of the time per slot.
        bucket = match_bucket(match)
        prior = [bucket / (bucket + 2.0)] * slots
        pooled = self.pooled.rates(prior, self.prior_weight)
        counts = self.by_match.get(bucket)
        return counts.rates(pooled, self.prior_weight) if counts is not None else pooled

    def plain_cost(self) -> Optional[float]:
        if self._dflash_measured():
            return self.dflash.cost(1)
        return self.costs.cost(1)

    def lookup_cost(self, width: int) -> Optional[float]:
        measured = [w for w in self.costs.measured_widths() if w > 1]
        plain = self.plain_cost()
        if not measured:
            return plain  # optimistic until measured, so lookup gets tried
        if width in measured or plain is None:
            return self.costs.cost(width)
        # A lookup pass is a plain step plus its extra rows, each costing about the same: an unmeasured width is
        # priced on the median per-row cost of the measured ones. One slow pass at a width (a hiccup of the
        # machine) then neither makes its neighbours look dear nor keeps wider copies from being tried.
        per_row = statistics.median(max(0.0, self.costs.cost(w) - plain) / (w - 1) for w in measured)
        return plain + per_row * (width - 1)

    def _best_lookup(self, offer: Offer):
        """(rate, width) of the best lookup pass for this offer (rate None while nothing is measured)."""
        widest = min(offer.max_width, self.lookup_width)
        rates = offer.rates or self.lookup_rates(offer.match, widest - 1)
        expected = expected_tokens(rates[: widest - 1])
        best = (None, 1)
        for w in range(2, widest + 1):
            cost = self.lookup_cost(w)
            if cost is None:
                return None, widest
            rate = expected[w - 1] / max(cost, 1e-9)
            if best[0] is None or rate > best[0] * 1.01:
                best = (rate, w)
        return best

    # -- the planner's calls (`offer` is the older form of `take`) --------------------------------------------------------------------------------------
    def offer(self, lookup: Optional[LookupDraft], dflash_rates: Optional[List[float]] = None) -> None:
        """The lookup continuation available for the next pass (None: no match), and optionally the drafter's own
        per-slot acceptance estimates for it, used instead of the running ones (see `take`)."""
        self.take(Offer(LOOKUP, len(lookup.tokens) + 1, lookup.tokens, lookup.match)
                  if lookup is not None and lookup.tokens else None,
                  Offer(DFLASH, 0, rates=dflash_rates) if dflash_rates is not None else None)

    def take(self, lookup: Optional[Offer], dflash: Optional[Offer] = None) -> None:
        """The proposers' offers for the next pass: lookup's copied continuation (None: no match) and the
        drafter's, whose `rates`, when a proposer supplies them before drafting, replace the running estimates."""
        self._offer = lookup if lookup is not None and lookup.tokens else None
        self._dflash_rates = dflash.rates if dflash is not None else None

    def choose(self) -> int:
        offer, self._offer, self._chosen = self._offer, None, None
        supplied, self._dflash_rates = self._dflash_rates, None
        if offer is not None:
            rate, w = self._best_lookup(offer)
            if rate is None and not self._dflash_measured():
                pass  # nothing measured yet: copy (a context match is the better first guess)
            else:
                rivals = self._rival_rate(supplied)
                if rate is None or rivals is None or rate <= rivals:
                    offer = None
            if offer is not None:
                self.source, self._chosen = LOOKUP, offer
                return w
        if supplied is not None and self._dflash_measured():
            w = self._best_supplied(supplied)[1]
        elif self.dflash is not None:
            w = self.dflash.choose()
        else:
            w = 1
        self.source = DFLASH if w > 1 else PLAIN
        return w

    def _best_supplied(self, rates: List[float]):
        """(rate, width) of the best DFlash pass (plain included) under per-slot estimates the drafter supplied."""
        expected = expected_tokens(rates[: self.dflash.max_width - 1])
        options = [(expected[w - 1] / max(self.dflash.cost(w), 1e-9), -w) for w in range(1, len(expected) + 1)]
        rate, w = max(options)
        return rate, -w

    def _rival_rate(self, supplied: Optional[List[float]] = None) -> Optional[float]:
        """The best rate without lookup: DFlash at its best width, or plain decoding."""
        if self._dflash_measured():
            if supplied is not None:
                return self._best_supplied(supplied)[0]
            return max(self.dflash.rates_per_second())
        plain = self.plain_cost()
        return 1.0 / plain if plain else None

    @property
    def lookup_tokens(self) -> List[int]:
        """The continuation of the lookup pass just chosen."""
        return self._chosen.tokens if self._chosen is not None else []

    def record(self, width: int, accepted: int, seconds: float) -> None:
        """One finished pass of the source last chosen."""
        # Every pass fades the lookup counts, so a match length that failed is retried after a while.
        for counts in [self.pooled, *self.by_match.values()]:
            counts.fade(self.decay)
        if self.source == LOOKUP and width > 1:
            self.costs.record(width, accepted, seconds)
            bucket = match_bucket(self._chosen.match if self._chosen is not None else MATCH_BUCKETS[0])
            self.pooled.add(accepted, width - 1)
            self.by_match.setdefault(bucket, _SlotCounts(self.lookup_width - 1)).add(accepted, width - 1)
        elif self.dflash is not None:
            self.dflash.record(width, accepted, seconds)
        else:
            self.costs.record(width, accepted, seconds)
