"""Prompt-lookup drafting: the context index, the per-pass source choice, and losslessness with lookup, DFlash and
plain passes mixed in one generation (greedy on every tiny family; sampling exactness is in test_sampling.py)."""

from __future__ import annotations

import pytest

import tiny
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.lookup import LookupIndex
from dflash_mlx.decode.sources import DFLASH, LOOKUP, PLAIN, SourceChoice, match_bucket
from dflash_mlx.decode.stats import AcceptanceStats
from dflash_mlx.decode.proposal import Offer
from dflash_mlx.decode.width import WidthPolicy


# -- the index ---------------------------------------------------------------------------------------------------------
def test_index_proposes_what_followed_the_longest_most_recent_match():
    index = LookupIndex(min_n=2, max_n=4)
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    draft = index.propose(3)
    # The suffix [1, 2, 3] last occurred before at positions 4..6, followed by 4, 5, 6 (not the older 9).
    assert draft.tokens == [4, 5, 6] and draft.match == 3
    index.extend([4])
    draft = index.propose(7)
    assert draft.tokens == [5, 6, 7, 1, 2, 3, 4] and draft.match == 4  # runs up to the newest token


def test_a_copy_that_runs_into_the_newest_token_goes_on_through_the_repeating_run():
    # A loop of period 3: the newest suffix last occurred 3 tokens back, so the copy runs into the newest token
    # after 3 tokens and continues as the loop repeats, as wide as asked.
    index = LookupIndex(min_n=2, max_n=4)
    index.extend([9, 8, 1, 2, 3, 1, 2, 3, 1, 2])
    draft = index.propose(8)
    assert draft.tokens == [3, 1, 2, 3, 1, 2, 3, 1]
    # Not a loop: an occurrence further back copies what followed it, the overlap repeating from there.
    index = LookupIndex(min_n=2, max_n=4)
    index.extend([5, 6, 7, 8, 5, 6])
    assert index.propose(2).tokens == [7, 8] and index.propose(5).tokens == [7, 8, 5, 6, 7]


def test_index_measures_the_match_beyond_max_n_and_misses_cleanly():
    index = LookupIndex(min_n=2, max_n=3, max_match=32)
    run = list(range(10, 30))
    index.extend(run + [99] + run[:12])
    draft = index.propose(4)
    assert draft.tokens == run[12:16] and draft.match == 12  # extended backwards past max_n
    index.extend([77, 78])  # an unseen bigram
    assert index.propose(4) is None
    assert LookupIndex().propose(4) is None and index.propose(0) is None


def test_index_grows_by_a_constant_per_token():
    index = LookupIndex(min_n=2, max_n=5)
    index.extend(tiny.prompt_ids(500, seed=3))
    assert len(index) == 500 and len(index._follow) <= 4 * 500
    # The newest suffix is never its own match: only an earlier occurrence proposes.
    fresh = LookupIndex(min_n=2, max_n=2)
    fresh.extend([5, 6])
    assert fresh.propose(3) is None


# -- lossless with every source mixed in one generation --------------------------------------------------------------
class ScriptedChoice(SourceChoice):  # also used by test_sampling.py
    """Sources and widths in a fixed rotation, whatever the estimates: ("lookup", w), ("dflash", w), ("plain", 1).
    A lookup turn without a match becomes a plain pass."""

    def __init__(self, schedule, dflash=True, lookup_width=6):
        super().__init__(WidthPolicy(8) if dflash else None, lookup_width)
        self.schedule, self.turn, self.seen = list(schedule), 0, []
        self.recorded = []

    def choose(self):
        source, w = self.schedule[self.turn % len(self.schedule)]
        self.turn += 1
        offer, self._offer = self._offer, None
        self._chosen = None
        if source == LOOKUP and offer is not None:
            self.source, self._chosen = LOOKUP, offer
            return min(w, offer.max_width)
        if source == DFLASH:
            self.source = DFLASH
            return w
        self.source = PLAIN
        return 1

    def record(self, width, accepted, seconds):
        self.recorded.append((self.source, width, accepted))
        super().record(width, accepted, seconds)


def _copying_prompt(seed: int):
    p = tiny.prompt_ids(10, seed=seed)
    return p + p[:6]  # the answer may continue the copy: lookup matches from the first pass


SCHEDULE = [(LOOKUP, 6), (DFLASH, 3), (LOOKUP, 4), (PLAIN, 1), (DFLASH, 4), (LOOKUP, 3)]


@pytest.mark.parametrize("kind", tiny.ALL_KINDS)
def test_greedy_lossless_with_lookup_dflash_and_plain_passes_mixed(kind):
    model = tiny.target(kind)
    drafter, t = tiny.make_drafter(model, block_size=4)
    totals = {LOOKUP: 0, DFLASH: 0, PLAIN: 0}
    lookup_accepted = 0
    for seed in (0, 1):
        prompt = _copying_prompt(seed)
        expected = tiny.reference(kind, prompt, 40)
        choice = ScriptedChoice(SCHEDULE)
        tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=40, lookup=LookupIndex(min_n=1),
                                         sources=choice)
        assert tokens == expected, (kind, seed)
        for c in cycles[1:]:
            totals[c.source] += 1
            lookup_accepted += c.accepted if c.source == LOOKUP else 0
        # The engine labels a pass cut to width 1 by the token limit "plain"; the choice still knows its turn.
        assert [(c.width, c.accepted) for c in cycles[1:]] == [(w, a) for _, w, a in choice.recorded]
        assert all(c.source == s for c, (s, w, _) in zip(cycles[1:], choice.recorded) if w > 1)
    assert all(totals.values()), totals  # every source ran
    assert lookup_accepted > 0  # copied drafts were accepted and rolled back partially somewhere


@pytest.mark.parametrize("kind", tiny.CORE_KINDS)
def test_adaptive_choice_and_lookup_alone_are_lossless(kind):
    model = tiny.target(kind)
    drafter, t = tiny.make_drafter(model, block_size=4)
    prompt = _copying_prompt(2)
    expected = tiny.reference(kind, prompt, 48, stop_tokens=[7])
    for d, lookup in ((drafter, None), (None, True)):
        g = Generation(t, d, prompt, max_tokens=48, stop_tokens=[7], lookup=lookup)
        passes = list(g)
        assert [tok for p in passes for tok in p.tokens] == expected, (kind, d is None)
        counts = g.stats.sources
        assert sum(n for n, _ in counts.values()) == len(passes) - 1
        assert sum(k for _, k in counts.values()) == len(expected) - 1
        if d is None:
            assert DFLASH not in counts
        assert g.sources is not None


def test_lookup_is_off_with_a_fixed_width_or_without_drafter_by_default():
    model = tiny.target("llama")
    drafter, t = tiny.make_drafter(model, block_size=4)
    prompt = _copying_prompt(0)
    assert Generation(t, drafter, prompt, max_tokens=4, width=3).sources is None
    plain = Generation(t, None, prompt, max_tokens=8)
    assert plain.sources is None and {p.source for p in plain} == {PLAIN}


def test_the_index_follows_a_conversation_across_generations():
    model = tiny.target("qwen2")
    drafter, t = tiny.make_drafter(model, block_size=4)
    state = DecodeState.fresh(t, drafter)
    first = tiny.prompt_ids(12, seed=5)
    out1 = [tok for p in Generation(t, drafter, first, max_tokens=10, state=state) for tok in p.tokens]
    index = state.extra["lookup"]
    assert index.tokens == first + out1
    second = tiny.prompt_ids(6, seed=6)
    out2 = [tok for p in Generation(t, drafter, second, max_tokens=10, state=state) for tok in p.tokens]
    assert state.extra["lookup"] is index and index.tokens == first + out1 + second + out2
    # A server restores a cached prefix into fresh caches and names its tokens: the index is built from them.
    g = Generation(t, drafter, [3], max_tokens=2, state=DecodeState.fresh(t, drafter), history=first)
    assert g.lookup.tokens == first


# -- the choice ----------------------------------------------------------------------------------------------------
def _offer(choice, tokens, match):
    from dflash_mlx.decode.lookup import LookupDraft

    choice.offer(LookupDraft(list(tokens), match))


def test_choice_learns_per_match_length_and_falls_back_to_plain():
    choice = SourceChoice(None, lookup_width=8, cost=lambda w: 1.0 + 0.05 * (w - 1))
    # Long matches are always fully accepted, short ones never.
    for _ in range(40):
        for match, accepted in ((16, 7), (2, 0)):
            _offer(choice, range(20), match)
            w = choice.choose()
            if choice.source == LOOKUP:
                choice.record(w, min(accepted, w - 1), 1.0)
            else:
                choice.record(1, 0, 1.0)
    _offer(choice, range(20), 16)
    assert choice.choose() == 8 and choice.source == LOOKUP
    choice.record(8, 7, 1.0)
    _offer(choice, range(20), 2)
    assert choice.choose() == 1 and choice.source == PLAIN
    assert choice.lookup_rates(16, 3)[0] > 0.9 > 0.2 > choice.lookup_rates(2, 3)[0]
    assert match_bucket(2) == 2 and match_bucket(5) == 4 and match_bucket(100) == 32


def test_choice_weighs_lookup_against_dflash_and_takes_supplied_rates():
    fixed = lambda w: 1.0 + 0.05 * (w - 1)  # noqa: E731
    dflash = WidthPolicy(4, cost=fixed)
    choice = SourceChoice(dflash, lookup_width=8, cost=fixed)
    for _ in range(30):  # the drafter gets every slot accepted: E(4) = 4
        choice.choose()
        choice.record(4, 3, 1.0)
    from dflash_mlx.decode.sources import Offer

    # A weak lookup offer loses to the drafter; one with supplied high per-slot rates wins.
    choice._offer = Offer(LOOKUP, 8, list(range(7)), 2, rates=[0.3] * 7)
    assert choice.choose() == 4 and choice.source == DFLASH
    choice.record(4, 3, 1.0)
    choice._offer = Offer(LOOKUP, 8, list(range(7)), 2, rates=[0.99] * 7)
    assert choice.choose() == 8 and choice.source == LOOKUP
    assert choice.lookup_tokens == list(range(7))
    choice.record(8, 7, 1.0)
    # A drafter's own per-slot estimates (a confidence head) replace the running ones for that pass.
    choice.offer(None, dflash_rates=[0.01, 0.01, 0.01])
    assert choice.choose() == 1 and choice.source == PLAIN
    choice.record(1, 0, 1.0)
    choice.offer(None)
    assert choice.choose() == 4 and choice.source == DFLASH


def test_narrow_lookup_widths_cost_between_a_plain_step_and_the_narrowest_measured():
    # Measured (as on a CPU at a long context): a plain step 0.5 s, an 8-wide lookup pass 0.9 s.
    dflash = WidthPolicy(4)
    choice = SourceChoice(dflash, lookup_width=16)
    for _ in range(10):  # a drafter whose drafts are never accepted: plain decoding is the rival
        dflash.record(4, 0, 0.7)
    dflash.record(1, 0, 0.5)
    choice.costs.record(8, 1, 0.9)
    assert choice.lookup_cost(2) == pytest.approx(0.5 + 0.4 / 7)
    assert choice.lookup_cost(5) == pytest.approx(0.5 + 0.4 * 4 / 7)
    assert choice.lookup_cost(8) == pytest.approx(0.9) and choice.lookup_cost(12) == pytest.approx(0.5 + 0.4 * 11 / 7)
    # So a 2-token match (half its guesses right) is copied 2 or 3 tokens wide, where pricing every narrower width
    # as the 8-wide pass made the widest copy look best: a miss now costs a tenth of a step, not four fifths.
    choice._offer = Offer(LOOKUP, 16, list(range(15)), 2, rates=[0.5] * 15)
    width = choice.choose()
    assert choice.source == LOOKUP and width <= 3


def test_one_slow_pass_neither_prices_its_neighbours_nor_keeps_a_loop_narrow():
    # Measured: a plain step 0.34 s, lookup passes of 2, 4 and 8 tokens at about 0.03 s a further row, and one
    # 21-token pass that hit a slow moment (1.72 s where 0.94 was due).
    dflash = WidthPolicy(4)
    choice = SourceChoice(dflash, lookup_width=32)
    for _ in range(10):
        dflash.record(4, 0, 0.5)
    dflash.record(1, 0, 0.34)
    for width, seconds in ((2, 0.37), (4, 0.43), (8, 0.55), (21, 1.72)):
        choice.costs.record(width, 1, seconds)
    assert choice.lookup_cost(21) == pytest.approx(1.72)  # its own measurement stands
    assert choice.lookup_cost(16) == pytest.approx(0.34 + 15 * 0.03, rel=0.01)  # not 1.27 (interpolated to it)
    # A loop copied 8 wide, every pass accepted whole: its estimates reach the slots no pass has checked, so the
    # next copy is wider than 8.
    for _ in range(20):
        choice._offer = Offer(LOOKUP, 32, list(range(31)), 32)
        assert choice.choose() > 1 and choice.source == LOOKUP
        choice.record(8, 7, 0.55)
    assert min(choice.lookup_rates(32, 31)[8:]) > 0.9
    choice._offer = Offer(LOOKUP, 32, list(range(31)), 32)
    assert choice.choose() >= 16


def test_stats_count_passes_and_tokens_per_source():
    stats = AcceptanceStats(adaptive=True)
    stats.record(3, 6, LOOKUP)
    stats.record(0, 4, DFLASH)
    stats.record(0, 1)
    assert stats.source_counts() == {"dflash": {"passes": 1, "tokens": 1}, "lookup": {"passes": 1, "tokens": 4},
                                     "plain": {"passes": 1, "tokens": 1}}
    assert stats.drafted_cycles == 1  # the collapse watch judges the drafter alone
    assert "lookup 1 / 4" in stats.format_sources() and "draft sources" in stats.format_histogram()


# -- front ends ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from dflash_mlx.demo import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def test_api_and_chat_run_lookup_alone(demo):
    from dflash_mlx.api import load, stream_generate
    from dflash_mlx.chat import ChatSession
    from dflash_mlx.errors import DFlashError

    model, tokenizer, drafter = load(str(demo[0]), "lookup")
    assert drafter == "lookup"
    prompt = "one two three four five six one two three four five six one two three"
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, None, max_tokens=24)]
    responses = list(stream_generate(model, tokenizer, prompt, "lookup", max_tokens=24))
    assert [r.token for r in responses] == plain
    assert {r.source for r in responses} <= {LOOKUP, PLAIN} and DFLASH not in responses[-1].stats.sources
    off = list(stream_generate(model, tokenizer, prompt, "lookup", max_tokens=8, lookup=False))
    assert {r.source for r in off} == {PLAIN}
    with pytest.raises(DFlashError, match="lookup"):
        next(stream_generate(model, tokenizer, prompt, "ngram", max_tokens=4))
    session = ChatSession(model, tokenizer, "lookup", max_tokens=8)
    for text in ("say one two three", "again"):
        "".join(session.send(text))
    assert len(session.state.extra["lookup"]) == len(session.seen)
    assert "draft sources: " in session.stats_text() and "(passes / tokens)" in session.stats_text()
