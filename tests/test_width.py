"""The adaptive verify width: unit tests of `width.WidthPolicy` on synthetic costs and acceptances, and the engine
staying lossless while the width changes every cycle (greedy here; sampling in test_sampling.py)."""

import random

import pytest

import tiny
from dflash_mlx.decode.width import FixedWidth, WidthPolicy, nominal_cost

B = 16


def cycle_seconds(width: int, drafting: float = 0.3, per_token: float = 0.1) -> float:
    """A synthetic machine: plain decoding costs 1, a drafting cycle pays for the draft plus a wider verify."""
    return 1.0 if width == 1 else 1.0 + drafting + per_token * (width - 1)


def drive(policy, accept, cycles, seconds=cycle_seconds, rng=None):
    """Run the policy against `accept(width, rng) -> accepted drafts`; returns the widths it chose."""
    rng = rng or random.Random(0)
    widths = []
    for _ in range(cycles):
        w = policy.choose()
        assert 1 <= w <= policy.max_width
        policy.record(w, accept(w, rng), seconds(w))
        widths.append(w)
    return widths


def useless(width, rng):
    return 0


def oracle(width, rng):
    return width - 1


def geometric(rate):
    """Each slot accepted with probability `rate` given the ones before it were."""
    def accept(width, rng):
        n = 0
        while n < width - 1 and rng.random() < rate:
            n += 1
        return n
    return accept


def test_useless_drafter_falls_back_to_plain_decoding():
    policy = WidthPolicy(B)
    widths = drive(policy, useless, 200)
    assert policy.best() == 1
    assert widths[-50:].count(1) >= 45  # probes only, a few percent of the time
    drafting = [w for w in widths[10:] if w > 1]
    spent = sum(cycle_seconds(w) - 1.0 for w in drafting)
    assert spent <= 0.05 * len(widths)  # probes cost at most a few percent over plain decoding


def test_a_cost_measured_in_a_busy_moment_does_not_stick():
    # A shared machine: one cycle in ten takes three times as long. Plain decoding must still win with a useless
    # drafter (its cost is re-measured even while a drafting width looks cheaper).
    rng = random.Random(1)
    policy = WidthPolicy(B)
    widths = drive(policy, useless, 200, seconds=lambda w: cycle_seconds(w) * (3 if rng.random() < 0.1 else 1))
    assert policy.best() == 1
    assert widths[50:].count(1) >= 0.85 * 150  # the rest are probes, paid from the probe budget:
    spent = sum(cycle_seconds(w) - 1.0 for w in widths[50:] if w > 1)
    assert spent <= 0.05 * sum(cycle_seconds(w) for w in widths[50:])


def test_nearly_free_drafting_does_not_buy_constant_probes():
    # A memory-bound CPU: verifying 2-8 tokens costs about one decode step and drafting a few percent, so every
    # probe looks cheap. A useless drafter must still cost at most a few percent over plain decoding.
    def seconds(w):
        return 1.0 if w == 1 else {2: 1.1, 4: 1.08, 8: 1.2}.get(w, 1.55)

    rng = random.Random(0)
    total = plain = 0.0
    for _ in range(5):  # five 128-token generations, each with a fresh policy
        widths = drive(WidthPolicy(B), useless, 127, lambda w: seconds(w) * rng.lognormvariate(0, 0.1))
        total += sum(seconds(w) for w in widths)
        plain += len(widths)
    assert total <= 1.03 * plain, total / plain


def test_oracle_drafter_stays_wide():
    policy = WidthPolicy(B)
    widths = drive(policy, oracle, 60)
    assert widths == [B] * len(widths)


def test_expensive_wide_verify_picks_a_middle_width():
    # Verify cost grows fast with width: the best width is neither 1 nor the block.
    def seconds(w):
        return 1.0 if w == 1 else 1.1 + 0.4 * (w - 1)

    policy = WidthPolicy(B)
    drive(policy, geometric(0.8), 300, seconds)
    rates = [sum(0.8 ** i for i in range(w)) / seconds(w) for w in range(1, B + 1)]
    true_best = 1 + rates.index(max(rates))
    assert abs(policy.best() - true_best) <= 1, (policy.best(), true_best)


def test_recovers_when_acceptance_improves():
    policy = WidthPolicy(B)
    drive(policy, useless, 150)
    assert policy.best() == 1
    widths = drive(policy, oracle, 150)
    assert policy.best() == B and widths[30:] == [B] * 120  # the next probes notice, within a few cycles
    widths = drive(policy, useless, 100)
    assert policy.best() == 1


def test_costs_are_measured_and_interpolated():
    policy = WidthPolicy(B)
    assert policy.choose() == B  # nothing measured yet
    policy.record(4, 3, 2.0)
    policy.record(12, 0, 4.0)
    assert policy.cost(8) == pytest.approx(3.0)
    assert policy.cost(16) == pytest.approx(4.0)  # flat above the widest measured
    assert policy.cost(1) == pytest.approx(0.6 * 2.0)  # a guess until plain decoding is measured
    policy.record(1, 0, 1.5)
    assert policy.cost(1) == pytest.approx(1.5)
    expected = policy.expected_tokens()
    assert expected[0] == 1.0 and all(b >= a for a, b in zip(expected, expected[1:]))


def test_fixed_cost_makes_choices_depend_on_acceptance_alone():
    runs = []
    for jitter in (0.5, 3.0):
        policy = WidthPolicy(B, cost=nominal_cost)
        runs.append(drive(policy, geometric(0.7), 80, seconds=lambda w: jitter * cycle_seconds(w)))
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_measurements_expire():
    policy = WidthPolicy(B, expire=10)
    policy.record(16, 15, 5.0)
    for _ in range(12):
        policy.record(2, 1, 1.0)
    assert 16 not in policy.costs and 2 in policy.costs


# -- the engine with a width that changes every cycle ---------------------------------------------------------------
class Scheduled:  # also used by test_sampling.py
    """A width sequence chosen in advance (cycled), whatever the acceptance."""

    def __init__(self, widths):
        self.widths, self.i, self.recorded = list(widths), 0, []

    def choose(self):
        w = self.widths[self.i % len(self.widths)]
        self.i += 1
        return w

    def record(self, width, accepted, seconds):
        assert seconds >= 0
        self.recorded.append((width, accepted))


WIDTH_SEQUENCES = [[1, 4, 2, 3], [3, 1, 1, 4, 2], [2, 4]]


@pytest.mark.parametrize("kind", tiny.CORE_KINDS)
@pytest.mark.parametrize("seq", range(len(WIDTH_SEQUENCES)))
def test_changing_width_is_lossless_greedy(kind, seq):
    prompt = tiny.prompt_ids(10, seed=seq)
    drafter, t = tiny.make_drafter(tiny.target(kind), block_size=4)
    width = Scheduled(WIDTH_SEQUENCES[seq])
    tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=20, planner=width)
    assert tokens == tiny.reference(kind, prompt, 20)
    widths = [c.width for c in cycles[1:]]
    assert len(set(widths)) > 1 and widths == [w for w, _ in width.recorded]


def test_changing_width_is_lossless_with_the_adaptive_policy_and_a_steered_drafter():
    kind = "qwen3"
    prompt = tiny.prompt_ids(8, seed=5)
    ref = tiny.reference(kind, prompt, 24)
    oracle_drafter = tiny.SteeredOracle(list(prompt) + ref, tiny.VOCAB, 4, tiny.VOCAB - 1, tiny.corrupt_every(3))
    t = tiny.TargetModel(tiny.target(kind), [0])
    tokens, cycles = tiny.run_dflash(prompt, t, oracle_drafter, max_tokens=24, planner=WidthPolicy(4))
    assert tokens == ref


def test_fixed_width():
    w = FixedWidth(3)
    w.record(3, 1, 0.1)
    assert w.choose() == 3


def _measured(max_width):
    policy = WidthPolicy(max_width, cost=nominal_cost)
    for w in range(1, max_width + 1):
        policy.record(w, w - 1, 0.0)
    return policy


def test_confidence_cut_follows_the_estimates():
    """`truncate`: estimates that stay high keep the widest block; one that drops cuts the block before its slot."""
    policy = _measured(8)
    assert policy.truncate([0.95] * 7, 8) == 8
    assert policy.truncate([0.95, 0.95, 0.02, 0.95, 0.95, 0.95, 0.95], 8) == 3
    assert policy.truncate([0.01] * 7, 8) == 2  # the first draft is always verified: it was paid for
    assert policy.truncate([0.95] * 7, 5) == 5  # never wider than the block drafted
    assert _measured(8).truncate([0.9] * 3, 8) == 4  # nor than the estimates given


def test_confidence_cut_is_a_stopping_time():
    """Whether slot i is verified depends on the head's estimates up to slot i only (slot i's estimate depends on
    the drafts before it, never its own): changing every estimate after the cut never changes the cut. That is what
    keeps sampling exact."""
    policy, rng = _measured(8), random.Random(0)
    widths = set()
    for _ in range(300):
        conf = [rng.random() for _ in range(7)]
        w = policy.truncate(conf, 8)
        widths.add(w)
        for _ in range(3):
            other = conf[:w] + [rng.random() for _ in range(7 - w)]
            assert policy.truncate(other, 8) == w
    assert len(widths) >= 4
