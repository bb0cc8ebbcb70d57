"""A memory soak of `dflash-mlx serve`: after a warm-up, hundreds of requests of mixed lengths on every route, some
streams dropped midway, under a small prefix-cache budget so entries are evicted all along; then the server
process's resident memory is compared with its level after the warm-up.

    python benchmarks/server_soak.py                      # the tiny demo pair, 500 requests
    python benchmarks/server_soak.py --model qwen2.5-coder-0.5b --requests 300 --cache-bytes 64MiB
    python benchmarks/server_soak.py --clients 3          # three clients at once: batched generations

Prints RSS after the warm-up and at the end, the growth in percent, MLX's active and cached buffer memory, the
prefix cache's bytes against its budget and its evictions; exits 1 when RSS grew by --max-growth percent or more,
or the prefix cache ever held more than its budget. The server runs in this process (on 127.0.0.1, a free port), so
the cache can be checked after every request; the client's own memory is small and reused.
`tests/test_server_soak.py` runs `soak` for a few dozen requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional

import httpx

WORDS = ("alpha beta gamma delta tensor cache token draft verify model loop array prompt stream reply python "
         "function class value index shape memory budget").split()
SYSTEMS = [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (8, 40, 120, 300)]
KINDS = ("chat", "chat_stream", "chat_drop", "completion", "responses", "responses_stream", "responses_drop",
         "responses_chain", "messages", "messages_stream")


def rss_bytes(pid: Optional[int] = None) -> int:
    """Resident memory of a process (this one by default): /proc on Linux, `ps` elsewhere (macOS)."""
    pid = pid or os.getpid()
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)]).split()[0]) * 1024


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _drop(client: httpx.Client, path: str, body: Dict, after: int) -> int:
    """Stream a reply and hang up after `after` lines: the server must stop that generation and free it."""
    with client.stream("POST", path, json=body) as reply:
        for i, _ in enumerate(reply.iter_lines()):
            if i >= after:
                break
        return reply.status_code


def one_request(client: httpx.Client, rng: random.Random, model: str, state: Dict) -> str:
    """Send one request of a random kind; returns its kind. Raises on an unexpected status."""
    kind = rng.choice(KINDS)
    system = rng.choice(SYSTEMS)
    user = _text(rng, 1, 60)
    max_tokens = rng.choice((1, 4, 16, 48))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    chat = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": rng.choice((0, 0.8))}
    responses = {"model": model, "instructions": system, "input": user, "max_output_tokens": max_tokens}
    anthropic = {"model": model, "system": system, "messages": messages[1:], "max_tokens": max_tokens}
    if kind == "chat":
        status = client.post("/v1/chat/completions", json=chat).status_code
    elif kind == "chat_stream":
        status = _drop(client, "/v1/chat/completions", dict(chat, stream=True), 10**9)
    elif kind == "chat_drop":
        status = _drop(client, "/v1/chat/completions", dict(chat, stream=True, max_tokens=64), rng.randint(1, 4))
    elif kind == "completion":
        status = client.post("/v1/completions", json={"model": model, "prompt": system + " " + user,
                                                      "max_tokens": max_tokens}).status_code
    elif kind == "responses":
        status = client.post("/v1/responses", json=dict(responses, store=rng.random() < 0.5)).status_code
    elif kind == "responses_stream":
        status = _drop(client, "/v1/responses", dict(responses, stream=True), 10**9)
    elif kind == "responses_drop":
        status = _drop(client, "/v1/responses", dict(responses, stream=True, max_output_tokens=64), rng.randint(2, 6))
    elif kind == "responses_chain":
        # A conversation that grows turn by turn through previous_response_id, restarted now and then.
        previous = state.get("previous") if rng.random() < 0.8 else None
        reply = client.post("/v1/responses", json=dict(responses, previous_response_id=previous))
        if reply.status_code == 404 and previous:  # dropped from the store or grown past the context: restart
            state.pop("previous", None)
            reply = client.post("/v1/responses", json=responses)
        if reply.status_code == 400 and "context length" in reply.text:
            state.pop("previous", None)
            reply = client.post("/v1/responses", json=responses)
        status = reply.status_code
        if status == 200:
            state["previous"] = reply.json()["id"]
    elif kind == "messages":
        status = client.post("/v1/messages", json=anthropic).status_code
    else:
        status = _drop(client, "/v1/messages", dict(anthropic, stream=True), 10**9)
    if status != 200:
        raise RuntimeError(f"{kind}: HTTP {status}")
    return kind


def soak(base: str, n: int, model: str, seed: int = 0, after_each: Optional[Callable[[int], None]] = None,
         clients: int = 1) -> Counter:
    """`n` mixed requests against the server at `base` (http://127.0.0.1:PORT) from `clients` threads at once
    (several: the server batches them), each sending its share one after another; `after_each(i)` runs after
    each. Returns the count of each kind; the first client error is raised."""
    kinds: Counter = Counter()
    lock = threading.Lock()

    def client_loop(k: int, share: int) -> None:
        rng, state = random.Random(seed * 1000 + k), {}
        with httpx.Client(base_url=base, timeout=300) as client:
            for i in range(share):
                kind = one_request(client, rng, model, state)
                with lock:
                    kinds[kind] += 1
                    done = sum(kinds.values())
                if after_each is not None:
                    after_each(done - 1)

    if clients <= 1:
        client_loop(0, n)
        return kinds
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client_loop, k, n // clients + (k < n % clients)) for k in range(clients)]
        for future in futures:
            future.result()
    return kinds


def settle(app) -> None:
    """Wait (bounded) until the worker is idle, so dropped streams have finished, and the server has given memory
    back as it does once idle (server/memory.py)."""
    server, keeper = app.state.server, app.state.memory
    gc.collect()
    deadline = time.monotonic() + 60
    while (server.worker.running or server.worker.waiting or not keeper.caught_up) and time.monotonic() < deadline:
        time.sleep(0.05)


def _load(args):
    from dflash_mlx import load

    if args.model:
        return load(args.model, args.draft)
    from dflash_mlx.demo import make_tiny_pair

    target_dir, drafter_dir = make_tiny_pair(tempfile.mkdtemp(prefix="dflash-soak-"))
    return load(str(target_dir), str(drafter_dir))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target to serve (default: the tiny demo pair, built in a temp dir)")
    parser.add_argument("--draft", help="drafter (default: the target's shipped one)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=60, help="requests before the baseline is taken")
    parser.add_argument("--cache-bytes", default="4MiB", help="prefix-cache budget, small so that it evicts")
    parser.add_argument("--max-growth", type=float, default=5.0, help="RSS growth (%%) that fails the run")
    parser.add_argument("--clients", type=int, default=1, help="clients sending at once (the server batches them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object too")
    args = parser.parse_args(argv)

    import logging

    import mlx.core as mx

    # An untrained drafter's acceptance collapses on every reply: that warning is not what this run is about.
    logging.getLogger("dflash_mlx").setLevel(logging.ERROR)

    from dflash_mlx.server import ServerSettings, create_app, start_in_thread
    from dflash_mlx.server import parse_bytes

    model, tokenizer, drafter = _load(args)
    budget = parse_bytes(args.cache_bytes)
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="soak", prompt_cache_bytes=budget))
    server = app.state.server
    cache = server.generator.cache
    peak = {"cache": 0}

    def check(i: int) -> None:
        peak["cache"] = max(peak["cache"], cache.nbytes)

    running = start_in_thread(app)
    try:
        t0 = time.perf_counter()
        soak(running.base, args.warmup, "soak", args.seed, check, args.clients)
        settle(app)
        base_rss = rss_bytes()
        t1 = time.perf_counter()
        kinds = soak(running.base, args.requests, "soak", args.seed + 1, check, args.clients)
        settle(app)
        end_rss = rss_bytes()
        t2 = time.perf_counter()
    finally:
        running.stop()
    growth = 100.0 * (end_rss - base_rss) / base_rss
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    print(f"requests from {args.clients} client(s): {args.warmup} warm-up ({t1 - t0:.0f} s) + {args.requests} "
          f"measured ({t2 - t1:.0f} s): "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    print(f"RSS after warm-up: {mib(base_rss)}   at the end: {mib(end_rss)}   growth: {growth:+.2f}% "
          f"(limit {args.max_growth}%)")
    print(f"MLX memory: active {mib(mx.get_active_memory())}, buffer cache {mib(mx.get_cache_memory())}; "
          f"idle releases: {app.state.memory.releases}")
    print(f"prefix cache: {len(cache)} entries, {mib(cache.nbytes)} now, {mib(peak['cache'])} at most, budget "
          f"{mib(budget)}; {cache.evictions} evictions, {cache.hits} hits, {cache.misses} misses")
    store = app.state.responses
    print(f"response store: {len(store)} entries, {mib(store.nbytes)} (budget {mib(store.max_bytes)})")
    ok = growth < args.max_growth and peak["cache"] <= budget
    if args.json:
        print(json.dumps({"rss_warm": base_rss, "rss_end": end_rss, "growth_pct": round(growth, 3),
                          "cache_peak": peak["cache"], "cache_budget": budget, "evictions": cache.evictions,
                          "ok": ok}))
    if not ok:
        print("FAIL: " + ("RSS grew too much" if growth >= args.max_growth else "the prefix cache exceeded its budget"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
