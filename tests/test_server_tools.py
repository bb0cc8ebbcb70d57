"""Tool calls and reasoning through the HTTP layer: `delta.tool_calls`, `reasoning_content`, Anthropic content
blocks, and no markup leaking into `content`.

A random tiny model cannot be made to write a tool call, so here the worker runs a scripted generator: it streams a
fixed reply through the real tokenizer and detokenizer, and everything after it (router, formatters, SSE, the openai
client's parsing) is the real path. `test_real_model_calls_a_tool` (slow) tries the default target.
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


class Scripted(Generator):
    """Replies with `REPLY` token by token, as the engine loop would hand it over."""

    def run(self, req, should_stop=lambda: False):
        tokens = self.tokenizer.encode(REPLY, add_special_tokens=False)
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
    server.worker.generator = Scripted(model, wrapped, drafter)
    running = start_in_thread(app)
    yield running, wrapped
    running.stop()


def test_tools_reach_the_prompt(live):
    _, tokenizer = live
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert '"get_weather"' in prompt.text


def test_tool_call_and_reasoning_whole(live):
    running, _ = live
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
    running, _ = live
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
    running, _ = live
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


@pytest.mark.slow
@pytest.mark.xfail(reason="qwen2.5-coder-0.5b answers this prompt with the bare JSON call, without the "
                          "<tool_call> tags its chat template asks for, so no parser sees a call (measured with "
                          "plain mlx-lm decoding too)", strict=False)
def test_real_model_calls_a_tool():
    from dflash_mlx.models import DEFAULT_MODEL

    model, tokenizer, drafter = load(DEFAULT_MODEL)
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="coder")))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=3000)
        r = client.chat.completions.create(model="coder", temperature=0, max_tokens=64, tools=TOOLS,
                                           messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        message = r.choices[0].message
        assert message.tool_calls, f"no tool call; the reply was {message.content!r}"
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] == "Paris"
        assert "<tool_call>" not in (r.choices[0].message.content or "")
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        running.stop()
