"""Load on `dflash-mlx serve`: N concurrent clients, streamed and not, a share of them abandoning mid-prefill and
mid-decode, for several rounds; is every completed reply exact, does the server go idle and keep its memory?

Starts `dflash-mlx serve` as a subprocess on 127.0.0.1 (the demo pair by default, or --model/--draft), then runs
--rounds rounds of --clients clients at once, one request each (greedy, chat completions, a shared system prompt
and a question of its own per client and round). Clients by index, in eights:
  0, 2  streamed, read to the end            1, 3, 7  not streamed, read to the end
  4     streamed, hangs up if its first token has not come within its patience (queued or mid-prefill)
  5     streamed, hangs up after its third chunk (mid-decode)
  6     not streamed, hangs up after its patience (queued, mid-prefill or mid-decode, whichever it is in)
(a leaver's patience: 1, 4, 7 or 10 times --patience, by the client's index)
so 3 in 8 (37.5%) abandon. Per round: requests served (200), refused with 503 by the queue bound (--max-queue),
abandoned, time to first token (streamed replies, as the client sees it: p50/p99), the server's resident memory
(sampled every 0.25 s: at the start, the peak, and --settle s after the round went idle), and the seconds from the last
client's leaving until the server reports nothing running or waiting (/health). Afterwards every completed reply is
asked for again alone, one request at a time, and compared. Everything stays on loopback and is bounded: the
clients per round, the rounds, each request's tokens and a time-out for each round.

    python benchmarks/server_load.py                          # demo pair, 32 clients x 3 rounds
    python benchmarks/server_load.py --clients 64 --max-queue 32 --json load.json

Exits 1 when a completed reply differs from its reply alone, the server took more than --idle-within s to go idle
after a round, or its idle RSS grew more than --max-growth percent from round 2 to round 3.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_soak import WORDS, rss_bytes  # noqa: E402

ROLES = ("stream", "plain", "stream", "plain", "stream_leave_prefill", "stream_leave_decode", "plain_leave", "plain")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_of(client: int, round_: int, system: str, words: int) -> List[Dict]:
    rng = random.Random(client * 1000 + round_)
    question = f"Question {round_}.{client}: " + _words(rng, rng.randint(words // 4, words))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _body(messages, max_tokens: int, stream: bool) -> Dict:
    return {"model": "load", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def one_client(base: str, role: str, messages, max_tokens: int, patience: float) -> Dict:
    """Send one request as `role`; returns status, reply text (completed ones), time to first token, how it ended."""
    stream = role.startswith("stream")
    tic = time.perf_counter()
    result: Dict = {"role": role, "status": None, "text": None, "ttft": None, "ended": "completed"}
    leaves_in_prefill = role == "stream_leave_prefill"
    read = patience if role in ("stream_leave_prefill", "plain_leave") else 3600
    timeout = httpx.Timeout(connect=30, read=read, write=30, pool=30)
    try:
        with httpx.Client(timeout=timeout) as client:
            if not stream:
                r = client.post(base + "/v1/chat/completions", json=_body(messages, max_tokens, False))
                result["status"] = r.status_code
                if r.status_code == 200:
                    result["text"] = r.json()["choices"][0]["message"]["content"]
                return result
            with client.stream("POST", base + "/v1/chat/completions", json=_body(messages, max_tokens, True)) as r:
                result["status"] = r.status_code
                if r.status_code != 200:
                    r.read()
                    return result
                text, chunks = [], 0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if delta and result["ttft"] is None:
                        result["ttft"] = time.perf_counter() - tic
                    chunks += 1
                    if leaves_in_prefill or (role == "stream_leave_decode" and chunks >= 3):
                        result["ended"] = "left in decode"
                        return result
                    text.append(delta)
                result["text"] = "".join(text)
                return result
    except httpx.ReadTimeout:  # a leaving client's patience ran out (before the first token, if streamed)
        result["ended"] = "left in prefill" if stream else "left (not streamed)"
        return result
    except httpx.HTTPError as e:  # counted, not hidden: a dropped connection is a finding
        result["ended"] = f"error: {type(e).__name__}"
        return result


class RssSampler:
    def __init__(self, pid: int, every: float = 0.25):
        self.pid, self.every, self.samples = pid, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
                return
            self._stop.wait(self.every)

    def between(self, t0: float, t1: float) -> List[int]:
        return [rss for t, rss in self.samples if t0 <= t <= t1]

    def stop(self):
        self._stop.set()


def wait_idle(base: str, limit: float) -> Optional[float]:
    """Seconds until /health reports nothing running or waiting (None: not within `limit`)."""
    tic = time.monotonic()
    while time.monotonic() - tic < limit:
        try:
            health = httpx.get(base + "/health", timeout=10).json()
            if not health["waiting"] and not health["running"]:
                return time.monotonic() - tic
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return None


def pct(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def counters(base: str) -> Dict[str, float]:
    """The server's generation counters (/metrics)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    names = ("dflash_generations_total", "dflash_generations_cancelled_total", "dflash_completion_tokens_total")
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.split()[:1] and
            line.split()[0] in names}


def run_round(base: str, round_: int, args, system: str, sampler: RssSampler) -> Dict:
    results: List[Optional[Dict]] = [None] * args.clients
    before = counters(base)
    start = time.monotonic()

    def client(i):
        role = ROLES[i % len(ROLES)]
        # Leavers' patience grows with the client's index (1x, 4x, 7x, 10x --patience): some leave while queued,
        # some in their prefill, some in their decode.
        patience = args.patience * (1 + 3 * ((i // len(ROLES)) % 4))
        results[i] = one_client(base, role, prompt_of(i, round_, system, args.user_words), args.max_tokens,
                                patience)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, start + args.round_timeout - time.monotonic()))
    last_left = time.monotonic()
    idle = wait_idle(base, 120)
    time.sleep(args.settle)  # the server gives freed memory back after a short idle spell (server/memory.py)
    settled = rss_bytes(sampler.pid)
    after = counters(base)
    end = time.monotonic()
    done = [r for r in results if r is not None]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None and r["ended"] == "completed"]
    rss = sampler.between(start, end)
    return {
        "round": round_ + 1, "clients": args.clients, "unfinished_clients": args.clients - len(done),
        "served_200": sum(r["status"] == 200 for r in done),
        "refused_503": sum(r["status"] == 503 for r in done),
        "other_status": sorted({r["status"] for r in done if r["status"] not in (200, 503, None)}),
        "completed": sum(r["ended"] == "completed" and r["status"] == 200 for r in done),
        "abandoned": sum(r["ended"] != "completed" for r in done),
        "how_they_ended": {k: sum(r["ended"] == k for r in done) for k in sorted({r["ended"] for r in done})},
        # Generations the server stopped as cancelled: one per client that left while its request ran (a leaver
        # whose generation ran on to its end instead is missing here), and the tokens generated in all.
        "generations": after["dflash_generations_total"] - before["dflash_generations_total"],
        "generations_cancelled": (after["dflash_generations_cancelled_total"] -
                                  before["dflash_generations_cancelled_total"]),
        "tokens_generated": after["dflash_completion_tokens_total"] - before["dflash_completion_tokens_total"],
        # Generations neither cancelled nor read to the end by their client: abandoned ones that ran on (0 is right).
        "abandoned_but_run_to_the_end": (after["dflash_generations_total"] - before["dflash_generations_total"]
                                         - (after["dflash_generations_cancelled_total"] -
                                            before["dflash_generations_cancelled_total"])
                                         - sum(r["ended"] == "completed" and r["status"] == 200 for r in done)),
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
        "seconds": round(last_left - start, 2), "idle_after_last_client_s": idle,
        "rss_start_mib": rss[0] / 2**20 if rss else None, "rss_peak_mib": max(rss) / 2**20 if rss else None,
        "rss_idle_mib": settled / 2**20,
        "results": results,
    }


def start_server(args, workdir: str):
    if args.model is None:
        from dflash_mlx.demo import make_tiny_pair

        target, drafter = make_tiny_pair(workdir, context=8192)
        model, draft = str(target), str(drafter)
    else:
        model, draft = args.model, args.draft
    port = _free_port()
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", "load", "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
           "--prefill-step-size", str(args.prefill_step_size), "--prompt-cache-bytes", args.prompt_cache_bytes] + (["--draft", draft] if draft else [])
    log = open(os.path.join(workdir, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {log.name}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base, log.name
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up within 600 s")
        time.sleep(0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the demo pair, built in a temporary folder")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=24, help="the server's queue bound (default: room for "
                        "32 clients beside --max-batch; lower it to see 503s)")
    parser.add_argument("--prompt-cache-bytes", default="32MiB", help="the server's prefix-cache budget (small: "
                        "full within the first round, so later rounds measure leaks rather than a filling cache)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle before the round's RSS is read")
    parser.add_argument("--prefill-step-size", type=int, default=256)
    parser.add_argument("--system-words", type=int, default=60)
    parser.add_argument("--user-words", type=int, default=100)
    parser.add_argument("--patience", type=float, default=1.0, help="seconds the leaving clients wait")
    parser.add_argument("--round-timeout", type=float, default=900.0)
    parser.add_argument("--idle-within", type=float, default=2.0)
    parser.add_argument("--max-growth", type=float, default=5.0)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.rounds <= 20:
        parser.error("--clients must be 1..256 and --rounds 1..20 (this is a bounded load)")

    workdir = tempfile.mkdtemp(prefix="dflash-load-")
    proc, base, log = start_server(args, workdir)
    sampler = RssSampler(proc.pid)
    system = "You are a helpful assistant. " + _words(random.Random(0), args.system_words)
    rounds = []
    try:
        one_client(base, "plain", prompt_of(999, 99, system, 8), 4, 0)  # warm-up
        for r in range(args.rounds):
            rounds.append(run_round(base, r, args, system, sampler))
            summary = {k: v for k, v in rounds[-1].items() if k != "results"}
            print(json.dumps(summary), flush=True)
        # Every completed reply, asked for again alone.
        checked = same = 0
        for r, report in enumerate(rounds):
            for i, res in enumerate(report["results"]):
                if res is None or res["ended"] != "completed" or res["status"] != 200:
                    continue
                alone = one_client(base, "plain", prompt_of(i, r, system, args.user_words), args.max_tokens, 0)
                checked += 1
                same += alone["text"] == res["text"]
    finally:
        sampler.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    idle_rss = [r["rss_idle_mib"] for r in rounds]
    growth = (idle_rss[2] / idle_rss[1] - 1) * 100 if len(idle_rss) >= 3 and idle_rss[1] else None
    slowest_idle = max((r["idle_after_last_client_s"] or float("inf")) for r in rounds)
    figures = {
        "clients": args.clients, "rounds": args.rounds, "max_batch": args.max_batch, "max_queue": args.max_queue,
        "requests": args.clients * args.rounds, "served_200": sum(r["served_200"] for r in rounds),
        "refused_503": sum(r["refused_503"] for r in rounds), "abandoned": sum(r["abandoned"] for r in rounds),
        "ttft_p50_s": pct([x["ttft"] for r in rounds for x in r["results"] if x and x["ttft"] and
                           x["ended"] == "completed"], 0.5),
        "ttft_p99_s": pct([x["ttft"] for r in rounds for x in r["results"] if x and x["ttft"] and
                           x["ended"] == "completed"], 0.99),
        "replies_checked_alone": checked, "replies_identical": same,
        "generations_cancelled": sum(r["generations_cancelled"] for r in rounds),
        "abandoned_but_run_to_the_end": sum(r["abandoned_but_run_to_the_end"] for r in rounds),
        "idle_after_last_client_max_s": slowest_idle, "rss_idle_mib_by_round": idle_rss,
        "rss_peak_mib_by_round": [r["rss_peak_mib"] for r in rounds], "rss_growth_round2_to_3_pct": growth,
        "server_log": log,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "rounds": [{k: v for k, v in r.items() if k != "results"}
                                                      for r in rounds]}, f, indent=1)
    ok = checked > 0 and same == checked and slowest_idle <= args.idle_within and (growth is None or growth <= args.max_growth)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
