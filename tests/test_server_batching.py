"""Concurrent requests on one server share verify passes (`--max-batch`), and every reply is exactly the reply the
same request gets alone (`dflash_mlx.generate`): greedy, seeded sampling, a client that leaves mid-way, a request
that joins while others are decoding."""

import json
import threading

import httpx
import pytest

from dflash_mlx import generate, load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

PROMPTS = [[5, 17, 23, 8, 41], [12, 3, 77, 9], [30, 31, 32, 33, 34, 35, 36], [60, 2, 2, 19, 44, 7]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("batch"))
    return load(str(target_dir), str(drafter_dir))


@pytest.fixture(scope="module")
def live(pair):
    app = create_app(*pair, ServerSettings(model_name="tiny", max_batch=4, prompt_cache_bytes=0))
    running = start_in_thread(app)
    yield running, app.state.server
    running.stop()


def _complete(base, ids, max_tokens, **options):
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, **options}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _concurrent(base, jobs):
    """Run `jobs` [(ids, max_tokens, options)] at once: the first starts streaming before the others are sent, so
    they join a batch in progress. Returns the replies' texts in order."""
    out = [None] * len(jobs)
    first_token = threading.Event()

    def lead():
        ids, n, options = jobs[0]
        body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True, **options}
        text = ""
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += choices[0]["text"] if choices else ""
                    first_token.set()
        out[0] = text

    def other(i):
        first_token.wait(60)
        out[i] = _complete(base, *jobs[i][:2], **jobs[i][2])

    threads = [threading.Thread(target=lead)] + [threading.Thread(target=other, args=(i,)) for i in
                                                 range(1, len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    first_token.set()
    return out


def test_concurrent_greedy_replies_equal_alone(pair, live):
    running, server = live
    jobs = [(PROMPTS[0], 160, {})] + [(p, 40, {}) for p in PROMPTS[1:]]
    got = _concurrent(running.base, jobs)
    model, tokenizer, drafter = pair
    assert got == [generate(model, tokenizer, ids, drafter, max_tokens=n) for ids, n, _ in jobs]
    assert max(server.generator.batch.sizes) >= 3  # the passes were shared


def test_concurrent_seeded_sampling_equals_alone(pair, live):
    running, server = live
    before = dict(server.generator.batch.sizes)
    options = [dict(temperature=0.9, seed=7), dict(temperature=0.8, seed=1, top_p=0.9), dict(temperature=1.0, seed=3),
               {}]
    jobs = [(PROMPTS[0], 120, options[0])] + [(p, 32, o) for p, o in zip(PROMPTS[1:], options[1:])]
    got = _concurrent(running.base, jobs)
    model, tokenizer, drafter = pair
    want = [generate(model, tokenizer, ids, drafter, max_tokens=n, temp=o.get("temperature", 0.0), seed=o.get("seed"),
                     top_p=o.get("top_p", 1.0)) for ids, n, o in jobs]
    assert got == want
    assert sum(server.generator.batch.sizes.get(k, 0) - before.get(k, 0) for k in (2, 3, 4)) > 0


def test_a_client_leaving_does_not_disturb_the_others(pair, live):
    running, server = live
    body = dict(model="tiny", prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True)
    results = {}

    def leaver():
        with httpx.stream("POST", running.base + "/v1/completions", json=body, timeout=120) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 6:
                    break  # closes the connection mid-reply

    def stayer(i):
        results[i] = _complete(running.base, PROMPTS[i], 48)

    threads = [threading.Thread(target=leaver)] + [threading.Thread(target=stayer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    model, tokenizer, drafter = pair
    assert results == {i: generate(model, tokenizer, PROMPTS[i], drafter, max_tokens=48) for i in (0, 1)}
    for _ in range(200):  # the leaver is stopped between two passes
        if server.worker.running == 0:
            break
        threading.Event().wait(0.05)
    assert server.worker.running == 0 and not server.generator.batch.members


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A qwen3_5 target (GatedDeltaNet + attention) with the demo tokenizer and a random drafter."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import _get_classes

    from cache_compare import CONFIGS
    from tiny import make_drafter, randomize

    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("hybrid"))
    tokenizer = load_tokenizer(target_dir)
    text = dict(CONFIGS["qwen3_5"]["text_config"], vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    config = dict(CONFIGS["qwen3_5"], text_config=text)
    model_class, args_class = _get_classes(config)
    model = randomize(model_class(args_class.from_dict(config)), 7)
    drafter, _ = make_drafter(model, vocab_size=len(tokenizer), mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))
    return model, tokenizer, drafter


def test_hybrid_concurrent_replies_equal_alone(hybrid):
    """GatedDeltaNet state per request, the prefix cache on: concurrent greedy and seeded replies equal alone."""
    app = create_app(*hybrid, ServerSettings(model_name="tiny", max_batch=4))
    running = start_in_thread(app)
    try:
        jobs = [(PROMPTS[0], 100, {}), (PROMPTS[1], 30, dict(temperature=0.9, seed=4)), (PROMPTS[2], 30, {})]
        got = _concurrent(running.base, jobs)
        sizes = app.state.server.generator.batch.sizes
    finally:
        running.stop()
    model, tokenizer, drafter = hybrid
    want = [generate(model, tokenizer, ids, drafter, max_tokens=n, temp=o.get("temperature", 0.0), seed=o.get("seed"))
            for ids, n, o in jobs]
    assert got == want
    assert max(sizes) >= 2


def test_lookup_only_server_replies_are_plain_greedy(pair):
    """`serve --draft lookup` (no drafter): concurrent replies equal mlx-lm's plain greedy ones, and passes that
    copied from the context had drafts accepted."""
    import mlx_lm

    model, tokenizer, _ = pair
    loop = [40, 41, 42, 43, 44, 45, 46, 47] * 4
    jobs = [(loop, 48, {}), (PROMPTS[1], 24, {}), (loop[:20], 24, {})]
    want = [mlx_lm.generate(model, tokenizer, ids, max_tokens=n) for ids, n, _ in jobs]
    app = create_app(model, tokenizer, "lookup", ServerSettings(model_name="tiny", max_batch=4))
    running = start_in_thread(app)
    try:
        # The server's first request: its planner has measured nothing yet, so its first pass copies the loop
        # (later choices follow measured seconds, which a loaded machine may tip either way).
        body = {"model": "tiny", "prompt": loop, "max_tokens": 32, "temperature": 0}
        r = httpx.post(running.base + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == mlx_lm.generate(model, tokenizer, loop, max_tokens=32)
        sources = r["dflash"]["sources"]
        assert "dflash" not in sources and sources["lookup"]["tokens"] > sources["lookup"]["passes"]  # copies kept
        assert _concurrent(running.base, jobs) == want
        models = httpx.get(running.base + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
    finally:
        running.stop()
