"""The Responses API (`/v1/responses`) and served-model aliases, through the real openai client on 127.0.0.1.

Plain replies are compared with `dflash_mlx.generate` on the same prompt tokens (so the route, the prompt building
and the prefix cache are checked for exactness); `previous_response_id` must both rebuild the conversation and hit
the prefix cache. The function-tool round trip runs on a scripted generator (a random tiny model cannot be made to
call a tool): it reads the prompt the server built and answers with a call, or with the tool's result once the
prompt holds it; router, formatter, SSE and the client's parsing are the real ones.
"""

import json

import httpx
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

from dflash_mlx import generate, load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.generation import Delta, Generator, Outcome

MODEL = "tiny"
ALIASES = ["gpt-4o-mini", "claude-3-5-haiku-latest"]

if not hasattr(openai.OpenAI, "responses"):
    pytest.skip("this openai client predates the Responses API", allow_module_level=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("responses"))
    return load(str(target_dir), str(drafter_dir))


@pytest.fixture(scope="module")
def live(pair):
    model, tokenizer, drafter = pair
    running = start_in_thread(create_app(model, tokenizer, drafter,
                                         ServerSettings(model_name=MODEL, served_names=list(ALIASES))))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


def _want(pair, messages, max_tokens):
    model, tokenizer, drafter = pair
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return ids, generate(model, tokenizer, ids, drafter, max_tokens=max_tokens)


def test_plain_equals_generate(pair, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello! How are you?"}]
    ids, want = _want(pair, messages, 16)
    r = client.responses.create(model=MODEL, instructions="You are terse.", input="Hello! How are you?",
                                max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == want
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == len(ids) and 1 <= r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    stats = r.model_extra["dflash"]
    assert r.usage.input_tokens_details.cached_tokens + stats["prefilled_tokens"] == len(ids)


def test_streamed_event_sequence(pair, client):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write a loop."}]}]
    _, want = _want(pair, [{"role": "user", "content": "Write a loop."}], 20)
    events = list(client.responses.create(model=MODEL, input=items, max_output_tokens=20, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == want == done.text == final.output_text
    assert final.usage.output_tokens >= 1 and (final.status == "incomplete") == (kinds[-1] == "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_previous_response_id_rebuilds_and_hits_the_cache(pair, client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a fruit.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, instructions="Be brief.", input="And a vegetable?",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And a vegetable?"}]
    ids, want = _want(pair, messages, 8)
    assert second.output_text == want and second.previous_response_id == first.id
    assert second.usage.input_tokens == len(ids)
    # The system prompt and the first turn come from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_unknown_or_unstored_previous_response_is_404(client, live):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    for bad in (r.id, "resp_nope"):
        reply = httpx.post(live.url + "/responses", json={"model": MODEL, "input": "x", "previous_response_id": bad})
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["param"] == "previous_response_id" and bad in error["message"]
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"type": "custom_tool_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "temperature": -1}, "temperature"),
])
def test_bad_requests_are_400_in_openai_shape(live, body, param):
    reply = httpx.post(live.url + "/responses", json=dict({"model": MODEL}, **body))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_served_names_on_every_route(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL] + ALIASES
    for name in ALIASES:
        assert client.models.retrieve(name).id == name
        assert client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2).model == name
        assert client.completions.create(model=name, prompt="Hi", max_tokens=2).model == name
        assert client.responses.create(model=name, input="Hi", max_output_tokens=2).model == name
        reply = httpx.post(live.base + "/v1/messages", json={"model": name, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.json()["model"] == name
    # A name the server does not list (an agent's own model id) is served by the one model, and carried back.
    assert client.responses.create(model="gpt-5", input="Hi", max_output_tokens=2).model == "gpt-5"
    reply = httpx.post(live.base + "/v1/messages", json={"model": "claude-opus-4-8", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200 and reply.json()["model"] == "claude-opus-4-8"
    # The catalogue still lists only the served names.
    assert httpx.get(live.url + "/models/gpt-5").status_code == 404


# -- function tools: a scripted generator ----------------------------------------------------------------------
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


class Scripted(Generator):
    """Calls get_weather until the prompt holds its result, then reports the result."""

    def run(self, req, should_stop=lambda: False, **_):
        prompt = self.tokenizer.decode(req.prompt)
        self.prompts.append(prompt)
        done = "<|im_start|>tool\n21 C, sunny" in prompt
        call = f"<think>Need data.</think><tool_call>\n{json.dumps(CALL)}\n</tool_call>"
        reply = "Paris: 21 C, sunny." if done else call
        tokens = self.tokenizer.encode(reply, add_special_tokens=False)
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for token in tokens:
            detokenizer.add_token(token)
            yield Delta(detokenizer.last_segment, [token])
        detokenizer.finalize()
        yield Delta(detokenizer.last_segment, [])
        stats = {"tau": 1.0, "cycles": 0, "verify_widths": {}, "drafted": 0, "accepted": 0, "fallback": True,
                 "generation_tps": 0.0, "prefilled_tokens": len(req.prompt)}
        yield Outcome("stop", len(req.prompt), len(tokens), 0, len(req.prompt), stats)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("responses_tools"))
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    hf = tokenizer._tokenizer
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>", "</tool_call>"]})
    hf.chat_template = TEMPLATE
    wrapped = TokenizerWrapper(hf, tool_parser=json_tools.parse_tool_call, tool_call_start="<tool_call>",
                               tool_call_end="</tool_call>")
    app = create_app(model, wrapped, drafter, ServerSettings(model_name=MODEL))
    generator = app.state.server.worker.generator = Scripted(model, wrapped, drafter)
    generator.prompts = []
    running = start_in_thread(app)
    yield openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=60), generator
    running.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(scripted, stream):
    client, generator = scripted

    def ask(**kwargs):
        if not stream:
            return client.responses.create(model=MODEL, tools=TOOLS, **kwargs), []
        events = list(client.responses.create(model=MODEL, tools=TOOLS, stream=True, **kwargs))
        return events[-1].response, events

    first, events = ask(input="Weather in Paris?")
    calls = [item for item in first.output if item.type == "function_call"]
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "Need data."
    (call,) = calls
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL["arguments"] and call.call_id
    assert '"get_weather"' in generator.prompts[-1]  # the tool reached the template
    if stream:
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(done.arguments) == CALL["arguments"]
        assert "<tool_call>" not in "".join(getattr(e, "delta", "") or "" for e in events)
    second, _ = ask(previous_response_id=first.id,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
    assert second.output_text == "Paris: 21 C, sunny."
    # The stored turn went back into the prompt as an assistant tool call, then the tool's result.
    prompt = generator.prompts[-1]
    rendered = json.loads(prompt[prompt.index("<tool_call>") + 11: prompt.index("</tool_call>")])
    assert rendered == CALL
    assert prompt.index("Weather in Paris?") < prompt.index("<tool_call>") < prompt.index("21 C, sunny")


def test_served_model_name_repeats_on_the_command_line(monkeypatch, capsys):
    import dflash_mlx.server as server_pkg
    from dflash_mlx.cli import main

    seen = {}

    def fake_serve(*, model, draft, quant, host, port, settings, prefill_step_size=None):  # serve_from_cli's own
        seen["settings"] = settings

    monkeypatch.setattr(server_pkg, "serve_from_cli", fake_serve)
    assert main(["serve", "--served-model-name", "coder", "--served-model-name", "gpt-4o-mini"]) in (0, None)
    assert seen["settings"].names == ["coder", "gpt-4o-mini"] and seen["settings"].model_name == "coder"
    assert main(["serve", "--served-model-name", " "]) == 2  # checked before anything loads
    assert "--served-model-name is empty" in capsys.readouterr().err
