"""Coding agents against the server: the request bodies Claude Code 2.1 and Codex 0.171 really send (recorded from
the real clients through tests/agents/recorder.py, kept in tests/fixtures/agents/) replayed on the demo pair, and
the pieces they rely on: system messages inside the conversation, their own model ids, Codex's namespace and
custom tools and history items, no output limit, signed thinking blocks, the over-long prompt wording, `HEAD /`,
and a long prefill that stops when its client leaves and resumes on the retry.

The real CLIs end to end: tests/test_agent_clients_e2e.py (slow).
"""

import copy
import json
import os
from pathlib import Path

import httpx
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

from dflash_mlx import load
from dflash_mlx.demo import AGENT_CONTEXT, make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.anthropic_format import MessagesFormatter
from dflash_mlx.server.generation import Delta, Generator, GenerationRequest, Outcome
from dflash_mlx.server.prompts import fold_system_messages
from dflash_mlx.server.responses_tools import ToolSet
from dflash_mlx.server.text import Piece

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CLAUDE_FIRST = "claude-code-2.1.197-first-request.json"
CODEX_FIRST = ["codex-0.171-gpt-5-codex-first-request.json", "codex-0.171-gpt-5.5-first-request.json"]
REPLY_TOKENS = 6  # the replays cap replies (a random model never stops by itself)


def fixture(name):
    return json.loads((FIXTURES / name).read_text())


def sse_events(text):
    """(event name or None, data) per SSE event."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is not None:
            out.append((name, None if data == "[DONE]" else json.loads(data)))
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("agents"), context=AGENT_CONTEXT)
    return load(str(target_dir), str(drafter_dir))


@pytest.fixture(scope="module")
def live(pair):
    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny", default_max_tokens=REPLY_TOKENS))
    running = start_in_thread(app)
    yield running, app
    running.stop()


def _shortened(value, limit=1500):
    """The body with every text over `limit` characters cut there: the same fields, roles, items and tools, a
    prompt a tiny model prefills in seconds."""
    if isinstance(value, dict):
        return {k: _shortened(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_shortened(v, limit) for v in value]
    return value[:limit] if isinstance(value, str) else value


def _replay(base, record, shorten=False, **changes):
    body = dict(copy.deepcopy(record["body"]), **changes)
    body = _shortened(body) if shorten else body
    headers = dict(record["headers"])
    query = f"?{record['query']}" if record.get("query") else ""
    return httpx.post(base + record["path"] + query, json=body, headers=headers, timeout=300)


# -- replays of the recorded first requests --------------------------------------------------------------------
def test_claude_code_first_request_streams_a_whole_message(live):
    running, _ = live
    record = fixture(CLAUDE_FIRST)
    assert any(m["role"] == "system" for m in record["body"]["messages"])  # what failed with a 400 before
    assert httpx.head(running.base + "/").status_code == 200  # its start-up probe
    reply = _replay(running.base, record, max_tokens=REPLY_TOKENS)
    assert reply.status_code == 200, reply.text
    events = sse_events(reply.text)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert events[0][1]["message"]["model"] == "claude-opus-4-8"  # its own id, served by the one model
    usage = events[-2][1]["usage"]
    assert usage["output_tokens"] == REPLY_TOKENS and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    count = httpx.post(running.base + "/v1/messages/count_tokens?beta=true", headers=record["headers"],
                       json={k: record["body"][k] for k in ("model", "messages", "system", "tools")})
    assert count.status_code == 200 and count.json()["input_tokens"] > 1000, count.text


@pytest.mark.parametrize("name", CODEX_FIRST)
def test_codex_first_request_streams_a_whole_response(live, name):
    running, _ = live
    record = fixture(name)
    kinds = {tool["type"] for tool in record["body"]["tools"]}
    assert kinds & {"namespace", "custom"} and "max_output_tokens" not in record["body"]
    reply = _replay(running.base, record, shorten=True)
    assert reply.status_code == 200, reply.text
    events = sse_events(reply.text)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and "response.output_item.done" in names
    final = events[-1][1]["response"]
    # No limit asked: the server's --max-tokens (set here) applies; without it, what the context leaves.
    assert final["usage"]["output_tokens"] == REPLY_TOKENS and final["model"] == record["body"]["model"]
    assert all(isinstance(final["usage"][k], int) for k in ("input_tokens", "output_tokens", "total_tokens"))


def test_a_request_without_a_limit_gets_what_the_context_leaves(pair):
    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny", context_length=64))
    server = app.state.server
    from dflash_mlx.server.prompts import Prompt

    prompt = Prompt(list(range(10, 30)), "x")
    assert server.generation_request(prompt, object(), None, []).max_tokens == 64 - 20
    assert server.generation_request(prompt, object(), 5, []).max_tokens == 5
    server.settings.default_max_tokens = 7
    assert server.generation_request(prompt, object(), None, []).max_tokens == 7
    server.worker.stop()


# -- model names -----------------------------------------------------------------------------------------------
def test_strict_model_names_answers_unknown_ids_with_404(pair):
    model, tokenizer, drafter = pair
    running = start_in_thread(create_app(model, tokenizer, drafter,
                                         ServerSettings(model_name="tiny", strict_model_names=True)))
    try:
        body = {"model": "claude-opus-4-8", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(running.base + "/v1/messages", json=body)
        assert reply.status_code == 404 and "tiny" in reply.json()["error"]["message"]
        chat = httpx.post(running.url + "/chat/completions", json={"model": "gpt-9", "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 404 and chat.json()["error"]["param"] == "model"
    finally:
        running.stop()


# -- Anthropic details -----------------------------------------------------------------------------------------
def test_system_messages_inside_the_conversation_join_the_user_turn():
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                {"role": "user", "content": "hi"}, {"role": "system", "content": "R1"},
                {"role": "assistant", "content": "ok"}, {"role": "system", "content": "R2"},
                {"role": "user", "content": "next"}, {"role": "assistant", "content": "done"},
                {"role": "system", "content": "R3"}]
    folded = fold_system_messages(messages)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user", "user", "assistant", "user"]
    assert folded[0]["content"] == "A\n\nB"
    assert folded[1]["content"] == "hi\n\n<system-reminder>\nR1\n</system-reminder>"
    assert folded[3]["content"] == "<system-reminder>\nR2\n</system-reminder>" and folded[4]["content"] == "next"
    assert folded[6]["content"] == "<system-reminder>\nR3\n</system-reminder>"
    assert fold_system_messages(messages[2:3]) == messages[2:3]
    # After a tool's result it joins the result; empty ones vanish. Where a note lands depends only on what came
    # before it, so the next turn's prompt extends this one's (the prefix cache serves it).
    loop = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "ok"}, {"role": "system", "content": "R"}, {"role": "system", "content": ""}]
    note = "ok\n\n<system-reminder>\nR\n</system-reminder>"
    assert fold_system_messages(loop)[2:] == [{"role": "tool", "content": note}]
    turn = fold_system_messages(loop)
    assert fold_system_messages(loop + [{"role": "assistant", "content": "done"}])[: len(turn)] == turn


def test_thinking_blocks_are_signed(pair):
    class Router:
        def __init__(self, pieces):
            self.pieces = pieces

        def feed(self, text, final=False):
            return [] if final else self.pieces

    pieces = [Piece("reasoning", "Let me think."), Piece("content", "Hi!")]
    outcome = Outcome("stop", 3, 2, 0, 3, {})
    streamed = MessagesFormatter("m", Router(pieces), 3)
    events = [e for line in streamed.start() + streamed.events(Delta("x", [1])) + streamed.finish(outcome)
              for e in sse_events(line)]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    signature = next(d for d in deltas if d["type"] == "signature_delta")["signature"]
    assert signature and deltas.index(next(d for d in deltas if d["type"] == "signature_delta")) == 1
    whole = MessagesFormatter("m", Router(pieces), 3)
    whole.events(Delta("x", [1]))
    block = whole.response(outcome)["content"][0]
    assert block["type"] == "thinking" and block["signature"] == signature


def test_an_over_long_prompt_is_refused_in_each_api_s_words(pair):
    model, tokenizer, drafter = pair
    running = start_in_thread(create_app(model, tokenizer, drafter,
                                         ServerSettings(model_name="tiny", context_length=32)))
    try:
        long = "hello " * 200
        reply = httpx.post(running.base + "/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                                "messages": [{"role": "user", "content": long}]})
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("prompt is too long: ") and "> 32 maximum" in message, message
        reply = httpx.post(running.url + "/responses", json={"model": "tiny", "input": long})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
        # A stream hears it in `response.failed`, where Codex looks for the code (and then compacts).
        reply = httpx.post(running.url + "/responses", json={"model": "tiny", "input": long, "stream": True})
        events = sse_events(reply.text)
        assert reply.status_code == 200 and [n for n, _ in events] == ["response.created", "response.failed"]
        error = events[-1][1]["response"]["error"]
        assert error["code"] == "context_length_exceeded" and "32" in error["message"]
        # Refused unseen (more text than the context could hold): the same event.
        huge = {"model": "tiny", "input": "x" * 40000, "stream": True}
        events = sse_events(httpx.post(running.url + "/responses", json=huge).text)
        assert events[-1][1]["response"]["error"]["code"] == "context_length_exceeded"
    finally:
        running.stop()


# -- Codex's tools and history ---------------------------------------------------------------------------------
def test_codex_tools_are_offered_as_functions():
    tools = fixture("codex-0.171-gpt-5.5-first-request.json")["body"]["tools"]
    tools += fixture("codex-0.171-gpt-5-codex-first-request.json")["body"]["tools"]
    toolset = ToolSet.from_request(tools)
    names = [t["function"]["name"] for t in toolset.chat_tools]
    assert "apply_patch" in names and "exec_command" in names
    assert any(n.startswith("multi_agent_v1__") for n in names)
    assert {"web_search", "tool_search"} <= set(toolset.dropped)
    patch = next(t["function"] for t in toolset.chat_tools if t["function"]["name"] == "apply_patch")
    assert patch["parameters"]["required"] == ["input"] and "*** Begin Patch" in patch["description"]
    member = next(n for n in names if n.startswith("multi_agent_v1__"))
    item = toolset.item({"name": member, "arguments": {"x": 1}})
    assert item["type"] == "function_call" and item["namespace"] == "multi_agent_v1"
    assert item["name"] == member.split("__", 1)[1] and json.loads(item["arguments"]) == {"x": 1}
    custom = toolset.item({"name": "apply_patch", "arguments": {"input": "*** Begin Patch\n*** End Patch\n"}})
    assert custom["type"] == "custom_tool_call" and custom["input"].startswith("*** Begin Patch")
    renamed = toolset.item({"name": "apply_patch", "arguments": {"patch": "*** Begin Patch\n"}})
    assert renamed["input"] == "*** Begin Patch\n"  # a small model's own name for the argument


TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
REPLIES = {  # the newest user text -> the scripted reply
    "patch": f'<tool_call>{json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})}</tool_call>',
    "spawn": '<tool_call>{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "go"}}</tool_call>',
}


class Scripted(Generator):
    """Answers with the tool call the prompt's last user text names, or "Done." once a tool's output is in."""

    def run(self, req, should_stop=lambda: False, **_):
        prompt = self.tokenizer.decode(req.prompt)
        self.prompts.append(prompt)
        last = prompt.rsplit("<|im_start|>user", 1)[-1]
        answered = "<|im_start|>tool\n" in prompt.rsplit("<tool_call>", 1)[-1]
        reply = "Done." if answered else next((r for k, r in REPLIES.items() if k in last), "Hi.")
        tokens = self.tokenizer.encode(reply, add_special_tokens=False)
        yield Delta(reply, tokens)
        stats = {"tau": 1.0, "cycles": 0, "verify_widths": {}, "drafted": 0, "accepted": 0, "fallback": True,
                 "generation_tps": 0.0, "prefilled_tokens": len(req.prompt)}
        yield Outcome("stop", len(req.prompt), len(tokens), 0, len(req.prompt), stats)


@pytest.fixture(scope="module")
def scripted(pair):
    model, tokenizer, drafter = pair
    hf = copy.deepcopy(tokenizer._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    hf.chat_template = TEMPLATE
    wrapped = TokenizerWrapper(hf, tool_parser=json_tools.parse_tool_call, tool_call_start="<tool_call>",
                               tool_call_end="</tool_call>")
    app = create_app(model, wrapped, drafter, ServerSettings(model_name="tiny"))
    generator = app.state.server.worker.generator = Scripted(model, wrapped, drafter)
    generator.prompts = []
    running = start_in_thread(app)
    yield running, generator
    running.stop()


def _codex_turn(running, tools, input_items, stream=True):
    body = {"model": "gpt-5.5", "instructions": "You are Codex.", "input": input_items, "tools": tools,
            "stream": stream, "store": False}
    reply = httpx.post(running.url + "/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not stream:
        return reply.json()["output"], []
    events = sse_events(reply.text)
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    return done, [name for name, _ in events]


def test_codex_custom_and_namespace_calls_round_trip(scripted):
    running, generator = scripted
    tools = fixture("codex-0.171-gpt-5.5-first-request.json")["body"]["tools"] + \
        [t for t in fixture("codex-0.171-gpt-5-codex-first-request.json")["body"]["tools"] if t["type"] == "namespace"]
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "please patch"}]}
    items, names = _codex_turn(running, tools, [user])
    (call,) = items
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch" and call["input"] == PATCH
    assert "response.custom_tool_call_input.delta" in names and "response.custom_tool_call_input.done" in names
    assert names[-1] == "response.completed"
    # The next turn carries the call and its output back, with items this server skips (reasoning, compaction)
    # and a developer message in the middle.
    history = [user, {"type": "reasoning", "summary": [], "encrypted_content": "x"}, call,
               {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Success."},
               {"type": "compaction", "encrypted_content": "y"},
               {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}]
    items, _ = _codex_turn(running, tools, history, stream=False)
    assert items[0]["type"] == "message" and items[0]["content"][0]["text"] == "Done."
    prompt = generator.prompts[-1]
    assert json.loads(prompt[prompt.index("<tool_call>") + 11: prompt.index("</tool_call>")]) == \
        {"name": "apply_patch", "arguments": {"input": PATCH}}
    assert prompt.index("please patch") < prompt.index("<tool_call>") < prompt.index("Success.")
    assert "<system-reminder>\nBe brief.\n</system-reminder>" in prompt and prompt.count("<|im_start|>system") == 2
    # A namespaced member is offered flat and comes back with its namespace apart.
    spawn = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "spawn one"}]}
    (call,), _ = _codex_turn(running, tools, [spawn])
    assert call["type"] == "function_call" and call["namespace"] == "multi_agent_v1"
    assert call["name"] == "spawn_agent" and json.loads(call["arguments"]) == {"message": "go"}
    items, _ = _codex_turn(running, tools, [spawn, call, {"type": "function_call_output", "call_id": call["call_id"],
                                                          "output": "spawned"}])
    assert '"name": "multi_agent_v1__spawn_agent"' in generator.prompts[-1]
    # A named custom tool forces that call.
    body = {"model": "gpt-5.5", "input": "anything", "tools": tools, "tool_choice": {"type": "custom",
                                                                                      "name": "apply_patch"}}
    reply = httpx.post(running.url + "/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert generator.prompts[-1].endswith('assistant\n<tool_call>{"name": "apply_patch", "arguments": ')


# -- a long prefill whose client has gone ----------------------------------------------------------------------
def test_an_abandoned_prefill_stops_within_a_chunk_and_its_retry_resumes(pair):
    model, tokenizer, drafter = pair
    step = 32
    prompt = tokenizer.encode("Hello! How are you today? " * 40)  # several chunks
    assert len(prompt) > 4 * step
    gen = Generator(model, tokenizer, drafter, prefill_step_size=step)
    request = GenerationRequest(prompt, max_tokens=8)
    plain = Generator(model, tokenizer, drafter, prefill_step_size=step, prompt_cache_bytes=0)
    want = [t for e in plain.run(request) if isinstance(e, Delta) for t in e.tokens]

    asked = []

    def leave_after_two_chunks():
        asked.append(1)
        return len(asked) > 2

    events = list(gen.run(request, should_stop=leave_after_two_chunks))
    outcome = events[-1]
    assert isinstance(outcome, Outcome) and outcome.finish_reason == "cancelled"
    assert outcome.completion_tokens == 0 and outcome.prefilled_tokens == 2 * step  # stopped within one chunk
    retry = list(gen.run(request))
    assert retry[-1].cached_tokens == 2 * step and retry[-1].finish_reason == "length"
    assert [t for e in retry if isinstance(e, Delta) for t in e.tokens] == want  # the resumed prefill is exact


# -- the launchers ---------------------------------------------------------------------------------------------
def _fake_client(folder, name):
    """A stand-in client on PATH that prints its arguments and the settings it was given, as JSON."""
    script = folder / name
    script.write_text("#!/usr/bin/env python3\nimport json, os, sys\nprint(json.dumps({'args': sys.argv[1:], 'env': "
                      "{k: v for k, v in os.environ.items() if k.startswith(('ANTHROPIC', 'API_', 'CLAUDE', "
                      "'DFLASH'))}}))\n")
    script.chmod(0o755)


def test_the_launchers_set_up_their_client_for_one_run(live, tmp_path, monkeypatch, capfd):
    from dflash_mlx.cli import main

    running, _ = live
    _fake_client(tmp_path, "claude")
    _fake_client(tmp_path, "codex")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-real-key")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["claude", "--url", running.base, "-p", "hi", "--output-format", "json"]) == 0
    seen = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert seen["args"] == ["-p", "hi", "--output-format", "json"]
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == running.base and "ANTHROPIC_API_KEY" not in env
    assert env["API_FORCE_IDLE_TIMEOUT"] == "0" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert main(["codex", "--url", running.url, "exec", "do it"]) == 0
    seen = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    args = seen["args"]
    assert args[-2:] == ["exec", "do it"] and seen["env"]["DFLASH_MLX_API_KEY"]
    overrides = dict(a.split("=", 1) for a in args[1:-2:2])
    assert overrides["model_provider"] == '"dflash"' and overrides["model"] == '"tiny"'
    assert overrides["model_providers.dflash.base_url"] == json.dumps(running.url)
    assert overrides["model_providers.dflash.wire_api"] == '"responses"'
    assert overrides["model_context_window"] == str(AGENT_CONTEXT)
    assert not any((tmp_path / d).exists() for d in (".claude", ".codex"))  # nothing written for the user


def test_a_launcher_without_its_client_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    from dflash_mlx.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["codex", "exec", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "npm install -g @openai/codex" in err
    assert main(["claude", "--url", "http://127.0.0.1:9", "-p", "hi"]) == 2
    assert "npm install -g @anthropic-ai/claude-code" in capsys.readouterr().err


def test_a_client_that_gives_up_during_prefill_leaves_it_for_the_retry(pair):
    """Through the server: a client times out while its long prompt is prefilled; the prefill stops, and the
    identical retry reports the chunks done as cached tokens; the server is idle afterwards."""
    import time

    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny", default_max_tokens=4))
    server = app.state.server
    generator = server.generator
    generator.prefill_step_size = 128
    advance = generator._advance

    def slow_advance(state, tokens):  # a slow machine: each chunk takes a third of a second at least
        time.sleep(0.33)
        advance(state, tokens)

    generator._advance = slow_advance
    running = start_in_thread(app)
    try:
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there! " * 400}]}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(running.base + "/v1/messages", json=body, timeout=1.0)
        def idle():
            deadline = time.monotonic() + 30
            while (server.worker.running or server.worker.waiting) and time.monotonic() < deadline:
                time.sleep(0.05)
            return server.worker.running == 0 and server.worker.waiting == 0

        assert idle()  # stopped, though its prompt was not done
        retry = httpx.post(running.base + "/v1/messages", json=body, timeout=120).json()
        usage = retry["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert 0 < usage["cache_read_input_tokens"] < prompt, usage
        assert usage["cache_read_input_tokens"] % 128 == 0 and retry["stop_reason"] == "max_tokens", (usage, prompt, retry)
        assert idle()
    finally:
        running.stop()
