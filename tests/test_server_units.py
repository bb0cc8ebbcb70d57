"""Server building blocks without HTTP: the prefix cache's trie, budget and snapshot exactness, stop strings
across piece boundaries, and the reasoning / tool-call router."""

import json

import mlx.core as mx
import pytest
from mlx_lm.tool_parsers import json_tools

from cache_compare import assert_caches_equal, build
from dflash_mlx.server.prefix_cache import PrefixCache, Snapshot
from dflash_mlx.server.text import OutputRouter, StopMatcher
from dflash_mlx.target import TargetModel
from tiny import make_drafter, prompt_ids, target


def _snapshot(t: TargetModel, drafter, ids, with_pending: int = 0):
    """Caches after `ids`; the last `with_pending` tokens' features are left out of the drafter's cache."""
    cache, dcache = t.make_cache(), drafter.make_cache()
    logits, hidden = t(mx.array([ids]), cache)
    split = len(ids) - with_pending
    drafter.append_context(hidden[:, :split], dcache)
    pending = hidden[:, split:] if with_pending else None
    mx.eval(logits, [c.state for c in cache], [c.state for c in dcache])
    return Snapshot.take(cache, dcache, pending, len(ids)), cache, dcache


def _fake(nbytes: int, cuttable: bool = True, length: int = 1) -> Snapshot:
    return Snapshot([], None, None, length, nbytes, cuttable)


def test_trie_finds_longest_usable_prefix():
    cache = PrefixCache(10_000)
    cache.insert([1, 2, 3, 4, 5], _fake(10, cuttable=False))
    cache.insert([1, 2, 3], _fake(10, cuttable=False))
    cache.insert([1, 2, 9, 9], _fake(10, cuttable=False))
    # Exact-only entries serve prompts that extend their whole key, leaving one token to prefill.
    assert cache.lookup([1, 2, 3, 4, 5, 6], 5).length == 5
    assert cache.lookup([1, 2, 3, 4, 5], 4).length == 3
    assert cache.lookup([1, 2, 3, 7], 3).length == 3
    assert cache.lookup([1, 2, 7], 2).snapshot is None
    # A cuttable entry serves any shared prefix, also from below the point where the prompt leaves the trie.
    cache.insert([5, 6, 7, 8], _fake(10))
    hit = cache.lookup([5, 6, 0], 2)
    assert hit.length == 2 and hit.snapshot.cuttable
    assert cache.lookup([5, 6, 7, 8], 3).length == 3


def test_lru_budget_and_redundant_prefixes():
    cache = PrefixCache(100)
    cache.insert([1, 2], _fake(40))
    cache.insert([1, 2, 3, 4], _fake(40))  # a cuttable entry makes cuttable entries on its path redundant
    assert len(cache) == 1 and cache.nbytes == 40
    cache.insert([7], _fake(40, cuttable=False))
    cache.lookup([1, 2, 3, 4, 5], 4)  # touch: [7] is now the oldest
    cache.insert([8, 8], _fake(40, cuttable=False))
    assert cache.lookup([7, 1], 1).snapshot is None and cache.evictions == 1
    assert cache.lookup([8, 8, 1], 2).length == 2
    assert cache.nbytes == 80
    assert not cache.insert([9], _fake(101))  # larger than the whole budget


def test_snapshots_restore_exactly_and_stay_frozen():
    model = target("qwen3")
    drafter, t = make_drafter(model)
    ids = prompt_ids(12, seed=3)
    snap, live, dlive = _snapshot(t, drafter, ids, with_pending=3)
    # Writing into the live caches, also over positions the snapshot holds, must not reach the frozen copy.
    t(mx.array([prompt_ids(5, seed=4)]), live)
    for c in live:
        c.trim(9)
    t(mx.array([prompt_ids(3, seed=6)]), live)
    mx.eval([c.state for c in live])
    for cut in (12, 7, 10):
        tc, dc, pending = snap.restore(cut)
        ref_t, ref_d = t.make_cache(), drafter.make_cache()
        _, hidden = t(mx.array([ids[:cut]]), ref_t)
        in_draft = min(cut, 9)
        drafter.append_context(hidden[:, :in_draft], ref_d)
        assert_caches_equal(tc, ref_t)
        assert_caches_equal(dc, ref_d)
        assert (pending is None) == (cut <= 9)
        if pending is not None:
            assert mx.array_equal(pending, hidden[:, 9:cut])
        # The restored caches are live: writing into them leaves the snapshot as it was.
        t(mx.array([[1, 2]]), tc)
    again, _, _ = snap.restore(12)
    ref = t.make_cache()
    t(mx.array([ids]), ref)
    assert_caches_equal(again, ref)


def test_hybrid_snapshots_are_exact_only():
    model = build("qwen3_5")
    drafter, t = make_drafter(model)
    ids = prompt_ids(9, seed=5)
    snap, live, _ = _snapshot(t, drafter, ids)
    assert not snap.cuttable
    with pytest.raises(ValueError):
        snap.restore(5)
    t(mx.array([[3, 4, 5]]), live)  # the live cache moves on
    tc, _, _ = snap.restore(9)
    ref = t.make_cache()
    t(mx.array([ids]), ref)
    assert_caches_equal(tc, ref)


def test_stop_strings_across_pieces():
    stop = StopMatcher(["END", "xyz"])
    pieces = ["hello E", "N", "Dtrailing"]
    out = "".join(stop.feed(p) for p in pieces)
    assert out == "hello " and stop.hit == "END"
    partial = StopMatcher(["END"])
    assert partial.feed("abcE") == "abc"  # "E" may start the stop string: held back
    assert partial.feed("x", final=True) == "Ex"


def test_router_splits_reasoning_and_tool_calls_in_any_pieces():
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = f"<think>let me see</think>Sure.<tool_call>\n{json.dumps(call)}\n</tool_call>"
    for size in (1, 2, 3, 7, len(text)):
        router = OutputRouter(("<think>", "</think>"), ("<tool_call>", "</tool_call>"), json_tools.parse_tool_call)
        pieces = []
        for i in range(0, len(text), size):
            pieces += router.feed(text[i : i + size])
        pieces += router.feed("", final=True)
        assert "".join(p.text for p in pieces if p.kind == "reasoning") == "let me see"
        assert "".join(p.text for p in pieces if p.kind == "content") == "Sure."
        assert [p.call for p in pieces if p.kind == "tool_call"] == [call]


def test_router_starts_in_reasoning_and_keeps_bad_tool_text():
    router = OutputRouter(("<think>", "</think>"), ("<tool_call>", "</tool_call>"), json_tools.parse_tool_call,
                          in_reasoning=True)
    pieces = router.feed("thinking...</think>answer<tool_call>{not json</tool_call>", final=True)
    assert [(p.kind, p.text) for p in pieces] == [("reasoning", "thinking..."), ("content", "answer"),
                                                  ("content", "{not json")]
