"""Tool calls and reasoning through the HTTP layer: `delta.tool_calls`, `reasoning_content`, Anthropic content
blocks, `tool_choice` (none / auto / required / a named function), bare-JSON calls, and no markup leaking into
`content`.

A random tiny model cannot be made to write a tool call, so here the worker runs a scripted generator: it reads the
prompt it is given (so a forced call's start must be there) and streams its reply through the real tokenizer and
detokenizer; everything after it (router, formatters, SSE, the openai client's parsing) is the real path. The slow
tests ask the default target (qwen2.5-coder-0.5b, about 4 minutes of CPU here).
"""

import json

import httpx
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.generation import Delta, Generator, Outcome
from dflash_mlx.server.prompts import chat_prompt

MODEL = "tiny"
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
REPLY = f"<think>The user wants the weather.</think>Let me check.<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


BARE = "```json\n" + json.dumps(CALL) + "\n```"


def _reply_to(prompt: str) -> str:
    """The scripted reply: continues a forced call where the prompt started one, else REPLY (BARE when asked)."""
    if prompt.endswith('"arguments": '):
        return json.dumps(CALL["arguments"]) + "}\n</tool_call>"
    if prompt.endswith('{"name": "'):
        return json.dumps(CALL)[len('{"name": "'):] + "\n</tool_call>"
    return BARE if "bare JSON please" in prompt else REPLY


class Scripted(Generator):
    """Replies as `_reply_to` says, token by token, as the engine loop would hand it over."""

    def run(self, req, should_stop=lambda: False, **_):
        self.last_prompt = self.tokenizer.decode(req.prompt)
        tokens = self.tokenizer.encode(_reply_to(self.last_prompt), add_special_tokens=False)
        detokenizer = self.tokenizer.detokenizer
        for token in tokens:
            detokenizer.add_token(token)
            yield Delta(detokenizer.last_segment, [token])
        detokenizer.finalize()
        yield Delta(detokenizer.last_segment, [])
        stats = {"tau": 1.0, "cycles": 0, "verify_widths": {}, "drafted": 0, "accepted": 0, "fallback": True,
                 "generation_tps": 0.0, "prefilled_tokens": len(req.prompt)}
        yield Outcome("stop", len(req.prompt), len(tokens), 0, len(req.prompt), stats)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("tools"))
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    hf = tokenizer._tokenizer
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>", "</tool_call>"]})
    hf.chat_template = TEMPLATE
    wrapped = TokenizerWrapper(hf, tool_parser=json_tools.parse_tool_call, tool_call_start="<tool_call>",
                               tool_call_end="</tool_call>")
    app = create_app(model, wrapped, drafter, ServerSettings(model_name=MODEL))
    server = app.state.server
    scripted = server.worker.generator = Scripted(model, wrapped, drafter)
    running = start_in_thread(app)
    yield running, wrapped, scripted
    running.stop()


def test_tools_reach_the_prompt(live):
    _, tokenizer, _ = live
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert '"get_weather"' in prompt.text


def test_tool_call_and_reasoning_whole(live):
    running, _, _ = live
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]
    assert call.id and call.type == "function"


def test_tool_call_and_reasoning_streamed(live):
    running, _, _ = live
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, tools=TOOLS,
                                                 messages=[{"role": "user", "content": "Weather in Paris?"}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert content == "Let me check." and "<" not in content
    assert reasoning == "The user wants the weather."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == CALL["arguments"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_anthropic_tool_use_blocks(live):
    running, _, _ = live
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}]}
    r = httpx.post(running.url + "/messages", json=body, timeout=60).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "text", "tool_use"]
    assert r["content"][2]["name"] == "get_weather" and r["content"][2]["input"] == CALL["arguments"]
    assert r["stop_reason"] == "tool_use"
    partial = ""
    with httpx.stream("POST", running.url + "/messages", json=dict(body, stream=True), timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                    partial += data["delta"]["partial_json"]
    assert json.loads(partial) == CALL["arguments"]
    # A tool result goes back in as a `tool` message.
    follow = dict(body, messages=body["messages"] + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C"}]}])
    assert httpx.post(running.url + "/messages", json=follow, timeout=60).status_code == 200


def _streamed(client, **kwargs):
    """Content, tool calls and finish reasons of a streamed chat reply."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(d.content or "" for d in deltas), calls, finish


WEATHER_IN_PARIS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_call(live, choice):
    running, tokenizer, scripted = live
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_IN_PARIS, tools=TOOLS, tool_choice=choice)
    # The assistant turn was started with the call: the prompt ends in the markup (and the named call's start).
    forced = "<tool_call>" + ('{"name": "get_weather", "arguments": ' if isinstance(choice, dict) else '{"name": "')
    assert scripted.last_prompt.endswith("<|im_start|>assistant\n" + forced)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]
    content, calls, finish = _streamed(client, messages=WEATHER_IN_PARIS, tools=TOOLS, tool_choice=choice)
    assert content == "" and finish == ["tool_calls"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather",
                                                                                      CALL["arguments"])]
    # Anthropic's forms of the same choice.
    body = {"model": MODEL, "max_tokens": 64, "messages": WEATHER_IN_PARIS,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather"} if isinstance(choice, dict) else {"type": "any"}}
    m = httpx.post(running.url + "/messages", json=body, timeout=60).json()
    assert [b["type"] for b in m["content"]] == ["tool_use"] and m["content"][0]["input"] == CALL["arguments"]
    assert scripted.last_prompt.endswith(forced)


def test_tool_choice_none_hides_the_tools(live):
    running, _, scripted = live
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_IN_PARIS, tools=TOOLS, tool_choice="none")
    assert "get_weather" not in scripted.last_prompt  # the template was not given the tools
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_IN_PARIS, tools=TOOLS, tool_choice="auto")
    assert "get_weather" in scripted.last_prompt and r.choices[0].message.tool_calls


def test_bad_tool_choice_is_a_400(live):
    running, _, _ = live
    for choice, tools in [({"type": "function", "function": {"name": "nope"}}, TOOLS), ("required", None),
                          ("sometimes", TOOLS)]:
        body = {"model": MODEL, "messages": WEATHER_IN_PARIS, "tool_choice": choice}
        if tools:
            body["tools"] = tools
        r = httpx.post(running.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_bare_json_call(live):
    running, _, _ = live
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris? bare JSON please"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    content, calls, finish = _streamed(client, messages=messages, tools=TOOLS)
    assert content == "" and finish == ["tool_calls"] and len(calls) == 1
    assert json.loads(calls[0].function.arguments) == CALL["arguments"]
    # Without tools it is what the model wrote.
    r = client.chat.completions.create(model=MODEL, messages=messages)
    assert r.choices[0].message.content == BARE and r.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def coder():
    from dflash_mlx.models.offline import DEFAULT_MODEL

    model, tokenizer, drafter = load(DEFAULT_MODEL)
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="coder")))
    yield openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=3000)
    running.stop()


def _ask_coder(client, **kwargs):
    r = client.chat.completions.create(model="coder", temperature=0, max_tokens=32, tools=TOOLS,
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                       **kwargs)
    return r.choices[0]


@pytest.mark.slow
@pytest.mark.parametrize("choice", [None, "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_real_model_calls_a_tool(coder, choice):
    """qwen2.5-coder-0.5b: on its own it answers with the bare JSON call (no <tool_call> tags); forced, the
    server starts the call in its template's markup."""
    choice_ = _ask_coder(coder, **({} if choice is None else {"tool_choice": choice}))
    message = choice_.message
    assert message.tool_calls, f"no tool call; the reply was {message.content!r}"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert not message.content and choice_.finish_reason == "tool_calls"


@pytest.mark.slow
def test_real_model_tool_choice_none(coder):
    choice = _ask_coder(coder, tool_choice="none")
    assert choice.message.tool_calls is None and choice.message.content
