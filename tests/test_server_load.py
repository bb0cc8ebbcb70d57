"""Concurrency: 16 streaming clients at once (4 leave early), every finished reply equal to its sequential run,
/health answering throughout, caches exact after the cancellations, and --max-queue turning excess away.

Nothing here depends on how threads happen to be scheduled: leavers' generations wait for their hang-up to be
seen, and metrics are read once the server is idle."""

import threading
import time

import httpx
import openai
import pytest

from dflash_mlx import generate, load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.generation import Delta

MODEL = "tiny"
TOPICS = ["the sea", "a fox", "numbers", "speculative decoding", "the sun", "a tiny model", "dogs", "code"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("load"))
    return load(str(target_dir), str(drafter_dir))


def _messages(i):
    # Pairs of requests share a system prompt, so cache hits and misses interleave.
    return [{"role": "system", "content": f"Topic {i // 2}."},
            {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} ({i})."}]


def _metric(text, name):
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


LEAVER_TOKENS = 1000


def _wait_for_the_hang_up(generator):
    """Pause a leaver's generation (it asks for LEAVER_TOKENS) after its second piece of text until the server
    has seen the client go. Without this, on a loaded machine the worker could finish or outrun a leaver before
    its client thread got to hang up, and the test would depend on thread scheduling. A server that never
    notices the hang-up still fails: the pause ends after a minute and the leaver runs on to its limit."""
    real_run = generator.run

    def run(req, should_stop=lambda: False, **options):
        texts = 0
        for event in real_run(req, should_stop, **options):
            yield event
            if req.max_tokens == LEAVER_TOKENS and isinstance(event, Delta) and event.text:
                texts += 1
                deadline = time.monotonic() + 60
                while texts == 2 and not should_stop() and time.monotonic() < deadline:
                    time.sleep(0.01)

    generator.run = run


def _wait_until_idle(running, timeout=120):
    """The last generation may still be stopping when its client thread has returned; its outcome (and its
    metrics) are recorded before the worker reports itself idle."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(running.base + "/health", timeout=30).json()
        if not health["waiting"] and not health["running"]:
            return
        assert time.monotonic() < deadline, f"the server is still busy after {timeout} s: {health}"
        time.sleep(0.05)


def test_sixteen_streaming_clients_four_leaving(pair):
    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name=MODEL))
    _wait_for_the_hang_up(app.state.server.worker.generator)
    running = start_in_thread(app)
    try:
        n, max_tokens, leavers = 16, 20, {3, 6, 9, 12}
        want = {i: generate(model, tokenizer, tokenizer.apply_chat_template(_messages(i), add_generation_prompt=True),
                            drafter, max_tokens=max_tokens) for i in range(n)}
        results, errors, health = {}, [], []
        done = threading.Event()

        def client(i):
            try:
                c = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
                stream = c.chat.completions.create(model=MODEL, messages=_messages(i), temperature=0, stream=True,
                                                   max_tokens=LEAVER_TOKENS if i in leavers else max_tokens)
                text = ""
                for k, chunk in enumerate(stream):
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if i in leavers and k >= 2:
                        stream.close()  # hang up mid-reply
                        return
                results[i] = text
            except Exception as e:  # pragma: no cover - reported below
                errors.append((i, repr(e)))

        def poll_health():
            try:
                while not done.is_set():
                    health.append(httpx.get(running.base + "/health", timeout=30).status_code)
                    time.sleep(0.1)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(("health", repr(e)))

        poller = threading.Thread(target=poll_health)
        poller.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        done.set()
        poller.join()

        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a client is still waiting after 300 s"
        _wait_until_idle(running)
        assert set(results) == set(range(n)) - leavers
        for i, text in results.items():
            assert text == want[i], f"client {i}"
        assert health and all(code == 200 for code in health)

        metrics = httpx.get(running.base + "/metrics").text
        # The leavers asked for 1000 tokens: their generations were stopped (at the pass after their hang-up was
        # seen), not run to the end.
        assert _metric(metrics, "dflash_generations_cancelled_total") == len(leavers), metrics
        assert _metric(metrics, "dflash_completion_tokens_total") < (n - len(leavers)) * max_tokens + 200
        # Their stopped states went into the prefix cache; replies built on them are still exact.
        c = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
        for i in sorted(leavers):
            r = c.chat.completions.create(model=MODEL, messages=_messages(i), temperature=0, max_tokens=max_tokens)
            assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
            assert r.choices[0].message.content == want[i]
    finally:
        running.stop()


def test_max_queue_answers_503(pair):
    model, tokenizer, drafter = pair
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name=MODEL, max_queue=1))
    worker = app.state.server.worker
    gate, real_run = threading.Event(), worker.generator.run

    def gated_run(req, should_stop=lambda: False, **options):  # the first generation waits for the gate
        gate.wait(timeout=120)
        yield from real_run(req, should_stop, **options)

    worker.generator.run = gated_run
    running = start_in_thread(app)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 8,
                "temperature": 0}
        codes = []

        def post():
            codes.append(httpx.post(running.url + "/chat/completions", json=body, timeout=300).status_code)

        first = threading.Thread(target=post)
        first.start()
        while not httpx.get(running.base + "/health").json()["running"]:
            time.sleep(0.02)
        second = threading.Thread(target=post)
        second.start()
        while not httpx.get(running.base + "/health").json()["waiting"]:
            time.sleep(0.02)
        r = httpx.post(running.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
        gate.set()
        first.join()
        second.join()
        assert codes == [200, 200]
        assert httpx.get(running.base + "/health").json() == {"status": "ok", "model": MODEL, "waiting": 0,
                                                              "running": 0}
    finally:
        gate.set()
        running.stop()
