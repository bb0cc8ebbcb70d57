"""`dflash-mlx serve` on the tiny demo pair: the real openai client against a live uvicorn server on 127.0.0.1.

Every reply is compared with `dflash_mlx.generate` on the same prompt tokens and options, so the HTTP layer,
the queue and the prefix cache (hits included) are checked for exactness, not just for shape.
"""

import json

import httpx
import openai
import pytest

from dflash_mlx import generate, load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

MODEL = "tiny"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("serve"))
    return load(str(target_dir), str(drafter_dir))


@pytest.fixture(scope="module")
def live(pair):
    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name=MODEL, drafter_name="demo-drafter"))
    running = start_in_thread(app)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


def _ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _reference(pair, ids, max_tokens, **kwargs):
    model, tokenizer, drafter = pair
    return generate(model, tokenizer, ids, drafter, max_tokens=max_tokens, **kwargs)


def _segments(pair, ids, max_tokens):
    """The reference reply's text, token by token (where token boundaries fall in the text)."""
    from dflash_mlx import stream_generate

    model, tokenizer, drafter = pair
    return [r.text for r in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_generate(pair, client, stream):
    tokenizer = pair[1]
    for i, text in enumerate(["Hello! How are you?", "Write a function that adds two numbers."]):
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
        ids = _ids(tokenizer, messages)
        want = _reference(pair, ids, 24)
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
            final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
            stats = final.model_extra["dflash"]
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            got, usage, stats = r.choices[0].message.content, r.usage, r.model_extra["dflash"]
            assert r.choices[0].finish_reason in ("stop", "length")
        assert got == want
        assert usage.prompt_tokens == len(ids)
        assert 1 <= usage.completion_tokens <= 24
        assert usage.prompt_tokens_details.cached_tokens + stats["prefilled_tokens"] == len(ids)
        assert stats["drafted"] >= stats["accepted"] >= 0 and stats["tau"] >= 1
        assert sum(stats["verify_widths"].values()) == stats["cycles"]
        assert stats["fallback"] == (stats["plain_passes"] > 0)  # the width policy's plain steps are visible


def test_sampled_chat_equals_generate_with_the_same_seed(pair, client):
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    ids = _ids(pair[1], messages)
    for seed in (1, 2):
        want = _reference(pair, ids, 16, temp=0.9, top_p=0.95, seed=seed)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                           top_p=0.95, seed=seed)
        assert r.choices[0].message.content == want


def test_repetition_penalty_sees_the_cached_prompt_too(pair, client):
    from dflash_mlx import stream_generate

    model, tokenizer, drafter = pair
    # A prompt that holds the tokens an unpenalized reply would use, so penalizing the prompt changes the reply.
    seed_ids = tokenizer.encode("Say something repetitive.")
    echo = [r.token for r in stream_generate(model, tokenizer, seed_ids, drafter, max_tokens=24)]
    ids = seed_ids + echo + seed_ids
    options = dict(repetition_penalty=2.0, repetition_context_size=256)
    want = _reference(pair, ids, 16, **options)
    for _ in range(2):  # the second request restores all but one prompt token from the prefix cache
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body=options)
        assert r.choices[0].text == want
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_logit_bias(pair, client):
    model, tokenizer, drafter = pair
    messages = [{"role": "user", "content": "Hello"}]
    ids = _ids(tokenizer, messages)
    favourite = tokenizer.encode(" the", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                       logit_bias={str(favourite): 100.0})
    from mlx_lm.sample_utils import make_logits_processors
    want = _reference(pair, ids, 6, logits_processors=make_logits_processors(logit_bias={favourite: 100.0}))
    assert r.choices[0].message.content == want == tokenizer.decode([favourite] * 6).lstrip()


def test_prefix_cache_on_attention_targets(pair, client):
    tokenizer = pair[1]
    first = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Hi there"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    ids1 = _ids(tokenizer, first)
    reply = r1.choices[0].message.content
    # The same request again: everything but the last prompt token comes from the cache.
    again = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids1) - 1
    assert again.choices[0].message.content == reply
    # A second turn reuses the first one's prompt and reply (as far as the reply re-tokenizes the same).
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    ids2 = _ids(tokenizer, second)
    gen1 = tokenizer.encode(reply, add_special_tokens=False)
    seen = ids1 + gen1
    common = next((i for i, (a, b) in enumerate(zip(seen, ids2)) if a != b), min(len(seen), len(ids2)))
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= min(common, len(ids1))
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids1)
    assert r2.choices[0].message.content == _reference(pair, ids2, 8)
    # A different conversation with the same system prompt shares its prefix.
    other = [first[0], {"role": "user", "content": "Something else entirely"}]
    r3 = client.chat.completions.create(model=MODEL, messages=other, max_tokens=4, temperature=0)
    ids3 = _ids(tokenizer, other)
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids3)) if a != b)
    assert r3.usage.prompt_tokens_details.cached_tokens == shared
    assert r3.choices[0].message.content == _reference(pair, ids3, 4)


def test_completions_text_and_token_prompts(pair, client):
    model, tokenizer, drafter = pair
    prompt = "The quick brown fox"
    want = _reference(pair, prompt, 12)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    assert r.choices[0].text == want
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    ids = tokenizer.encode(prompt)
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_chat_logprobs_are_the_targets(pair, client):
    messages = [{"role": "user", "content": "Count to three."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    for item in items:
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert item.logprob <= 0


def test_stop_string_across_token_boundaries(pair, client):
    messages = [{"role": "user", "content": "Hello there"}]
    ids = _ids(pair[1], messages)
    segments = [s for s in _segments(pair, ids, 30)]
    text = "".join(segments)
    # A stop string made of the end of one token's text and the start of the next one's.
    k = next(i for i in range(3, len(segments) - 1) if segments[i] and segments[i + 1]
             and text.find(segments[i][-1] + segments[i + 1][0]) == len("".join(segments[:i + 1])) - 1)
    stop = segments[k][-1] + segments[k + 1][0]
    cut = text.index(stop)
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                         temperature=0, stop=[stop], stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                               stop=[stop])
            got, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert got == text[:cut]
        assert finish == ["stop"]


def test_models_health_and_metrics(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["dflash"]["drafter"] == "demo-drafter"
    assert httpx.get(live.base + "/health").json()["status"] == "ok"
    text = httpx.get(live.base + "/metrics").text
    for name in ("dflash_requests_total", "dflash_tau", "dflash_verify_width_total", "dflash_queue_waiting",
                 "dflash_prefix_cache_hits_total", "dflash_completion_tokens_total"):
        assert name in text
    completed = [line for line in text.splitlines() if line.startswith("dflash_generations_total ")]
    assert int(completed[0].split()[-1]) > 0


BAD = [
    ("not json", None, 400, None),
    ({"model": MODEL, "messages": "hello"}, None, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, None, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages.0.role"),
    ({"model": MODEL, "messages": []}, None, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, None, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, None, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, 400, "messages.0.content"),
    ({"model": MODEL, "prompt": list(range(50)) * 100, "max_tokens": 4}, "/v1/completions", 400, "messages"),
    ({"model": MODEL, "prompt": [10**9], "max_tokens": 4}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, None, 400,
     "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     None, 400, "response_format"),
]


def test_bad_input_gets_an_openai_error_and_the_server_lives(live, pair, client):
    for body, path, status, param in BAD:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(live.url.removesuffix("/v1") + (path or "/v1/chat/completions"), content=content,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
        if param is not None:
            assert error["param"] == param, (body, error)
    too_long = httpx.post(live.base + "/v1/completions", json=BAD[-4][0]).json()["error"]
    assert too_long["code"] == "context_length_exceeded"
    assert httpx.get(live.base + "/health").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                       max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_api_key(pair):
    model, tokenizer, drafter = pair
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name=MODEL, api_key="s3")))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url, api_key="wrong", max_retries=0).models.list()
        r = httpx.post(running.url + "/messages", headers={"x-api-key": "nope"},
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["type"] == "error"
        good = openai.OpenAI(base_url=running.url, api_key="s3", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(running.base + "/health").status_code == 200  # health stays open
    finally:
        running.stop()


def test_anthropic_messages(pair, live):
    tokenizer = pair[1]
    body = {"model": MODEL, "max_tokens": 12, "system": "Be brief.", "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    ids = _ids(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    want = _reference(pair, ids, 12)
    r = httpx.post(live.url + "/messages", json=body, timeout=60).json()
    assert r["type"] == "message" and r["content"][0]["type"] == "text"
    assert r["content"][0]["text"] == want
    assert r["stop_reason"] in ("end_turn", "max_tokens")
    assert r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"] == len(ids)
    events, text = [], ""
    with httpx.stream("POST", live.url + "/messages", json=dict(body, stream=True), timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "content_block_delta":
                    text += data["delta"]["text"]
    assert text == want
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in events and "content_block_stop" in events
    count = httpx.post(live.url + "/messages/count_tokens", json=body).json()
    assert count["input_tokens"] == len(ids)
    bad = httpx.post(live.url + "/messages", json={"model": MODEL, "messages": body["messages"]})  # no max_tokens
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"


def test_lazy_weights_made_on_another_thread(pair):
    """A drafter whose weights were never evaluated (built on this thread) still serves from the worker thread."""
    from dflash_mlx.drafters.dflash import DFlashDrafter

    model, tokenizer, drafter = pair
    fresh = DFlashDrafter(drafter.config)  # lazy random weights
    running = start_in_thread(create_app(model, tokenizer, fresh, ServerSettings(model_name=MODEL)))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
    finally:
        running.stop()


def test_plain_decoding_is_visible(pair):
    model, tokenizer, drafter = pair
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name=MODEL, width=1)))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Hello"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        stats = r.model_extra["dflash"]
        assert stats["fallback"] is True and stats["drafted"] == 0
        assert stats["verify_widths"] == {"1": stats["cycles"]}
        assert r.choices[0].message.content == _reference(pair, _ids(tokenizer, messages), 8)
        card = client.models.list().data[0].model_extra["dflash"]  # the fixed verify width, by its name
        assert card["width"] == 1 and card["adaptive_width"] is False and "block_size" not in card
    finally:
        running.stop()


def test_forced_tool_call_continues_the_forced_start(pair, client):
    """A named tool_choice on a tokenizer without a tool parser: the assistant turn starts with the call as bare
    JSON, and the reply is `generate` continuing exactly that prompt (the random model botches the arguments, so
    the whole call comes back as text, forced start included)."""
    model, tokenizer, drafter = pair
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    start = '{"name": "get_weather", "arguments": '
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text + start, add_special_tokens=False)
    want = _reference(pair, ids, 8)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, tools=tools,
                                       tool_choice=choice)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == start + want
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 tools=tools, tool_choice=choice, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == start + want
