"""Server building blocks without HTTP: the prefix cache's trie, budget and snapshot exactness, stop strings
across piece boundaries, the reasoning / tool-call router, bare-JSON tool calls and `tool_choice`."""

import json

import mlx.core as mx
import pytest
from mlx_lm.tool_parsers import json_tools

from cache_compare import assert_caches_equal, build
from dflash_mlx.server.prefix_cache import PrefixCache, Snapshot
from dflash_mlx.server.errors import APIError
from dflash_mlx.server.text import OutputRouter, StopMatcher
from dflash_mlx.server.tools import (ForcedStart, ToolChoice, anthropic_tool_choice, could_be_bare_call,
                                     forced_start, openai_tool_choice, parse_bare_calls)
from dflash_mlx.targets import TargetModel
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


NAMES = ["get_weather", "get_time"]
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize("text", [
    json.dumps(WEATHER),
    "  \n" + json.dumps(WEATHER, indent=2) + "\n",
    "```json\n" + json.dumps(WEATHER) + "\n```",
    "```\n" + json.dumps(WEATHER) + "\n```\n",
    json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}),  # arguments as a string
    json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}),
])
def test_bare_call_forms(text):
    assert parse_bare_calls(text, NAMES) == [WEATHER]
    assert all(could_be_bare_call(text[:k]) for k in range(len(text) + 1))


def test_bare_call_lists_and_what_stays_text():
    two = [WEATHER, {"name": "get_time", "arguments": {}}]
    assert parse_bare_calls(json.dumps(two), NAMES) == two
    assert all(could_be_bare_call(json.dumps(two)[:k]) for k in range(len(json.dumps(two)) + 1))
    for text in [json.dumps({"name": "delete_all", "arguments": {}}),  # not an offered tool
                 json.dumps({"name": "get_weather", "arguments": {}, "extra": 1}),  # not the call shape
                 json.dumps({"name": "get_weather", "arguments": [1]}),
                 json.dumps(WEATHER) + " and then some text",
                 "Sure: " + json.dumps(WEATHER),
                 "[]", "{}", '{"city": "Paris"}', "```python\nprint(1)\n```", "plain text"]:
        assert parse_bare_calls(text, NAMES) is None, text
    # A stream stops holding text back as soon as it cannot become a call.
    for text, k in [("Sure, here", 1), ('{"city": "Paris"}', 3), (json.dumps(WEATHER) + " more", None),
                    ("```python\nx", 10), ("[1, 2]", 2)]:
        k = len(text) if k is None else k
        assert not could_be_bare_call(text[:k]), text[:k]


def _route(router, text, size):
    pieces = []
    for i in range(0, len(text), size):
        pieces += router.feed(text[i : i + size])
    return pieces + router.feed("", final=True)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_router_bare_json_calls(size):
    reply = "```json\n" + json.dumps(WEATHER) + "\n```"
    pieces = _route(OutputRouter(bare_names=NAMES), reply, size)
    assert [(p.kind, p.call) for p in pieces] == [("tool_call", WEATHER)]
    # After reasoning, too.
    router = OutputRouter(("<think>", "</think>"), bare_names=NAMES)
    pieces = _route(router, "\n<think>hm</think>\n\n" + json.dumps(WEATHER), size)
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == "hm"
    assert [p.call for p in pieces if p.kind == "tool_call"] == [WEATHER]
    assert "".join(p.text for p in pieces if p.kind == "content") == "\n"
    # Text is text, and streams as it comes (nothing held once it cannot be a call).
    router = OutputRouter(bare_names=NAMES)
    first = router.feed("Hello, ")
    assert [(p.kind, p.text) for p in first] == [("content", "Hello, ")]
    # JSON that is no call of an offered tool comes back whole as text.
    other = json.dumps({"name": "rm", "arguments": {}})
    assert "".join(p.text for p in _route(OutputRouter(bare_names=NAMES), other, size)) == other
    # Without tools offered, a bare call is text.
    assert [p.kind for p in _route(OutputRouter(), json.dumps(WEATHER), size)] == ["content"] * \
        len(_route(OutputRouter(), json.dumps(WEATHER), size))


def test_router_markup_call_releases_held_text():
    router = OutputRouter(tool=("<tool_call>", "</tool_call>"), parse_tool=json_tools.parse_tool_call,
                          bare_names=NAMES)
    pieces = _route(router, '{"na <tool_call>' + json.dumps(WEATHER) + "</tool_call>", 2)
    assert "".join(p.text for p in pieces if p.kind == "content") == '{"na '
    assert [(p.kind, p.call) for p in pieces][-1] == ("tool_call", WEATHER)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_router_forced_starts(size):
    markup = ForcedStart('<tool_call>\n{"name": "get_weather", "arguments": ',
                         '{"name": "get_weather", "arguments": ', markup=True)
    router = OutputRouter(tool=("<tool_call>", "</tool_call>"), parse_tool=json_tools.parse_tool_call,
                          bare_names=NAMES, forced=markup)
    pieces = _route(router, '{"city": "Paris"}}\n</tool_call>', size)
    assert [(p.kind, p.call) for p in pieces] == [("tool_call", WEATHER)]
    bare = ForcedStart('{"name": "get_weather", "arguments": ', '{"name": "get_weather", "arguments": ',
                       markup=False)
    pieces = _route(OutputRouter(bare_names=NAMES, forced=bare), '{"city": "Paris"}}\nDone.', size)
    assert [(p.kind, p.call) for p in pieces][0] == ("tool_call", WEATHER)
    assert "".join(p.text for p in pieces[1:] if p.kind == "content") == "\nDone."
    # A forced call the model botched is shown whole, forced start included.
    pieces = _route(OutputRouter(bare_names=NAMES, forced=bare), "oops", size)
    assert "".join(p.text for p in pieces) == bare.call_text + "oops"


def test_tool_choice_forms_and_errors():
    tools = [{"type": "function", "function": {"name": n}} for n in NAMES]
    assert openai_tool_choice(None, tools) == ToolChoice("auto")
    assert openai_tool_choice("none", tools) == ToolChoice("none")
    assert openai_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert openai_tool_choice(named, tools) == ToolChoice("named", "get_time")
    assert anthropic_tool_choice({"type": "any"}, tools) == ToolChoice("required")
    assert anthropic_tool_choice({"type": "tool", "name": "get_time"}, tools) == ToolChoice("named", "get_time")
    assert anthropic_tool_choice(None, None) == ToolChoice("auto")
    for bad, offered in [("always", tools), ({"type": "function", "function": {"name": "nope"}}, tools),
                         ({"type": "function"}, tools), ("required", None), (named, [])]:
        with pytest.raises(APIError) as e:
            openai_tool_choice(bad, offered)
        assert e.value.status == 400 and e.value.param == "tool_choice"


def test_forced_start_per_parser():
    from types import SimpleNamespace

    from mlx_lm.tool_parsers import qwen3_coder

    qwen = SimpleNamespace(has_thinking=True, think_start="<think>", think_end="</think>", has_tool_calling=True,
                           tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                           tool_parser=json_tools.parse_tool_call,
                           chat_template="... <tool_call>\\n{\"name\": ...}\\n</tool_call> ...")
    named, required = ToolChoice("named", "get_weather"), ToolChoice("required")
    start = forced_start(qwen, named, "<|im_start|>assistant\n")
    assert start.text == '<tool_call>\n{"name": "get_weather", "arguments": ' and start.markup
    assert start.call_text == '{"name": "get_weather", "arguments": '
    assert forced_start(qwen, required, "assistant\n").text == '<tool_call>\n{"name": "'
    # A prompt that opened a reasoning block has it closed before the call.
    assert forced_start(qwen, named, "assistant\n<think>\n").text.startswith("</think>\n\n<tool_call>")
    assert forced_start(qwen, ToolChoice("auto"), "x") is None
    coder = SimpleNamespace(**dict(vars(qwen), tool_parser=qwen3_coder.parse_tool_call, chat_template=""))
    assert forced_start(coder, named, "x").text == "<tool_call><function=get_weather>\n"
    # No tool parser: the call is started as bare JSON.
    plain = SimpleNamespace(has_thinking=False, has_tool_calling=False, tool_call_start=None, tool_parser=None)
    start = forced_start(plain, named, "x")
    assert start.text == start.call_text == '{"name": "get_weather", "arguments": ' and not start.markup
