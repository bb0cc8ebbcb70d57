"""`dflash-mlx serve` started as 2 ranks (ring backend, 127.0.0.1), tensor and pipeline parallel: rank 0 answers
HTTP exactly as one process does, a client that leaves mid-stream stops both ranks at the same pass (the next
replies are still exact, prefix cache included), and stopping rank 0 stops every rank. Plus the pieces in process:
requests on the wire, the prefix-cache digest the ranks compare."""

from __future__ import annotations

import http.client
import json
import re
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.distributed.local import LocalRanks, free_ports

LIMIT = 120  # seconds for the whole 2-rank server's life; a rank that lost step would hang, and is killed
REQUESTS = [
    ("/v1/completions", dict(prompt="Hello there", max_tokens=16, temperature=0)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Write a function that adds."}],
                                  max_tokens=16, temperature=0.9, seed=3)),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # qwen2: mlx-lm splits it both ways (by heads, and into pipeline stages).
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="qwen2")


@pytest.fixture(scope="module")
def single(pair):
    """The replies of one process serving the whole target."""
    from dflash_mlx import load
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread

    running = start_in_thread(create_app(*load(str(pair[0]), str(pair[1])), ServerSettings(model_name="tiny")))
    try:
        return _replies(running.base)
    finally:
        running.stop()


def _post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _replies(base: str) -> list:
    return [(_text(r), r["usage"]["completion_tokens"]) for r in (_post(base, p, b) for p, b in REQUESTS)]


def _leave_mid_stream(host: str, port: int) -> None:
    """Start a long streamed reply, read its first chunks, hang up."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    body = dict(prompt="Once upon a time", max_tokens=400, temperature=0, stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline()
    conn.close()


def _wait_healthy(base: str, ranks: LocalRanks) -> None:
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in ranks.procs), ranks.wait(1)
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail("the 2-rank server did not come up")


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_rank_server_answers_like_one_process(pair, single, split):
    port = free_ports(1)[0]
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(pair[0]), "--draft", str(pair[1]),
            "--port", str(port), "--served-model-name", "tiny"] + (["--pipeline"] if split == "pipeline" else [])
    with LocalRanks(argv, 2) as ranks:
        _wait_healthy(base, ranks)
        assert _replies(base) == single
        _leave_mid_stream("127.0.0.1", port)
        # No seed: the ranks must still draw alike (a rank that drew otherwise would hang the next collective).
        unseeded = _post(base, "/v1/completions", dict(prompt="Hello there", max_tokens=12, temperature=1.0))
        assert unseeded["usage"]["completion_tokens"] == 12
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(base, "/v1/completions", dict(prompt="Hello", max_tokens=4, logit_bias={"5": 3.0}))
        assert refused.value.code == 400 and b"logit_bias is not supported" in refused.value.read()
        # Both ranks stopped after the same pass and kept identical caches: the next replies are still exact.
        assert _replies(base) == single
        with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert re.search(r"generations_cancelled_total(\{[^}]*\})? 1\b", metrics), metrics  # it did stop early
        ranks.procs[0].send_signal(signal.SIGTERM)  # what mlx.launch sends to stop its ranks
        rank0, rank1 = ranks.wait(LIMIT)
    assert not rank0.timed_out and not rank1.timed_out, rank0.stderr[-2000:] + rank1.stderr[-2000:]
    # Rank 0 ends as after Ctrl-C (exit 130, "interrupted"), having told rank 1, which ends cleanly.
    assert rank0.returncode == 130 and "stopped 2 ranks" in rank0.stderr, rank0.stderr[-2000:]
    assert rank1.returncode == 0, rank1.stderr[-2000:]
    assert rank1.stdout == rank1.stderr == ""
    assert len(single[0][0]) > 0 and single[0][1] == 16


def test_requests_travel_whole_and_logit_bias_is_refused():
    from mlx_lm.sample_utils import make_logits_processors

    from dflash_mlx.distributed.serving import decode_request, encode_request
    from dflash_mlx.errors import DFlashError
    from dflash_mlx.server.generation import GenerationRequest

    sampling = dict(temp=0.7, top_p=0.9, top_k=5, min_p=0.0, seed=None, repetition_penalty=1.1,
                    repetition_context_size=20)
    req = GenerationRequest([1, 2, 3], 9, [2], sampling, ["\n\n"], True, 2)
    assert decode_request(encode_request(req)) == req
    req.sampling["logits_processors"] = make_logits_processors(logit_bias={3: 1.0})
    with pytest.raises(DFlashError, match="logit_bias is not supported"):
        encode_request(req)


def test_cache_digest_sees_keys_and_eviction_order():
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.distributed.serving import cache_digest
    from dflash_mlx.server.prefix_cache import PrefixCache, Snapshot

    def filled(*keys):
        cache = PrefixCache(1 << 20)
        for key in keys:
            cache.insert(key, Snapshot.take([KVCache()], None, None, len(key)))
        return cache

    a, b = [1, 2, 3], [1, 2, 4, 5]
    assert cache_digest(filled(a, b)) == cache_digest(filled(a, b))
    assert cache_digest(filled(a, b)) != cache_digest(filled(b, a))  # same keys, other eviction order
    assert cache_digest(filled(a)) != cache_digest(filled(a, b)) != cache_digest(PrefixCache(1))
