"""A recorded agent session through `dflash-mlx serve` against `generate`'s defaults on the same prompts, and
all of its requests at once against each alone.

    python benchmarks/server_vs_generate.py benchmarks/sessions/codex-rename-stdev --max-tokens 256

One loaded pair (default: qwen2.5-coder-0.5b and its shipped drafter), greedy. Three runs of every request of the
session (recorded as `benchmarks/agent_session.py` replays them):
- **server, one at a time**: the server with its defaults (batches of up to 8, draft trees "auto", the planner that
  remembers across requests, the prefix cache), each request sent after the last one's reply;
- **generate**: the very prompt ids the server decoded (recorded from its worker) decoded by `stream_generate`
  with its defaults, which is what `dflash-mlx generate` runs: a planner that starts cold for every prompt. Each
  prompt continues a copy of one prefill of the prompts' longest common prefix (the target's and the drafter's
  caches and the lookup index, exactly what a prefill of the whole prompt would hold), so the session's long
  shared context is prefilled once instead of once per request; decode speed does not depend on it;
- **server, all at once**: every request sent together (one client each); each reply must equal its reply alone.

Prints per request the decode tok/s of the server alone and of generate, their ratio and whether the token ids
match, then the totals (tokens over decode seconds) and the concurrent replies' identity. The two single runs
alternate request by request, so a machine whose speed drifts affects both alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_session import load_session, reply_of  # noqa: E402


class Recorder:
    """The server's generator, recording each request's prompt ids and the token ids it committed."""

    def __init__(self, generator):
        self.generator = generator
        self.runs: List[Dict[str, Any]] = []

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def run(self, req, **kwargs):
        record = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "tokens": []}
        self.runs.append(record)
        for event in self.generator.run(req, **kwargs):
            record["tokens"].extend(getattr(event, "tokens", None) or [])
            yield event


def send(client: httpx.Client, base: str, record: Dict[str, Any]) -> Dict[str, Any]:
    body = dict(record["body"], stream=True)
    query = f"?{record['query']}" if record.get("query") else ""
    reply = client.post(base + record["path"] + query, json=body, headers=record.get("headers") or {})
    if reply.status_code != 200:
        raise SystemExit(f"{record['path']} answered {reply.status_code}: {reply.text[:300]}")
    return reply_of(record["path"], reply.text)


def common_prefix(prompts: List[List[int]]) -> int:
    n = min(len(p) for p in prompts) - 1  # every prompt keeps at least one token to prefill
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return n


def generate_from(target, tokenizer, drafter, snapshot, prefix: List[int], prompt: List[int], max_tokens: int):
    """stream_generate's defaults on `prompt`, continuing a copy of the prefilled `prefix`: (token ids, decode
    tok/s)."""
    import mlx.core as mx

    from dflash_mlx import stream_generate
    from dflash_mlx.decode.lookup import LookupIndex
    from dflash_mlx.decode.state import DecodeState

    target_cache, draft_cache, pending = snapshot.restore(len(prefix))
    state = DecodeState(target_cache, draft_cache, pending_context=pending)
    index = LookupIndex()
    index.extend(prefix)
    state.extra["lookup"] = index
    tokens, last = [], None
    for response in stream_generate(target, tokenizer, mx.array(prompt[len(prefix):]), drafter,
                                    max_tokens=max_tokens, state=state):
        tokens.append(response.token)
        last = response
    return tokens, last.generation_tps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", type=Path, help="folder of recorded requests")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--max-tokens", type=int, default=256, help="limit replies whose request sets none")
    parser.add_argument("--prompt-cache-dir", type=Path, default=None, help="the server's prefix cache on disk, "
                        "as serve --prompt-cache-dir (a rerun then skips the server's prefill of the session)")
    args = parser.parse_args(argv)
    records = load_session(args.session)
    if not records:
        raise SystemExit(f"error: no recorded generation requests in {args.session}")

    from dflash_mlx import load
    from dflash_mlx.decode.state import DecodeState, prefill_alone
    from dflash_mlx.models.loading import prepare
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread
    from dflash_mlx.server.prefix_cache import Snapshot

    import mlx.core as mx

    model, tokenizer, drafter = load(args.model, args.draft)
    settings = ServerSettings(model_name="session", default_max_tokens=args.max_tokens,
                              prompt_cache_dir=str(args.prompt_cache_dir) if args.prompt_cache_dir else None)
    app = create_app(model, tokenizer, drafter, settings)
    recorder = Recorder(app.state.server.generator)
    app.state.server.worker.generator = recorder
    running = start_in_thread(app)
    target = prepare(model, drafter)
    rows, snapshot, prefix = [], None, None
    try:
        with httpx.Client(timeout=httpx.Timeout(None)) as client:
            # The server's first request also gives the prompt the generate runs share (its prefix).
            for i, record in enumerate(records):
                served = send(client, running.base, record)
                run = recorder.runs[-1]
                if snapshot is None:
                    prefix = run["prompt"][: len(run["prompt"]) - 1]
                    print(f"prefilling {len(prefix)} shared prompt tokens for generate", file=sys.stderr, flush=True)
                    state = DecodeState.fresh(target, drafter)
                    prefill_alone(target, drafter, mx.array(prefix), state)
                    snapshot = Snapshot.take(state.target_cache, state.draft_cache, state.pending_context,
                                             len(prefix))
                if common_prefix([prefix + [-1], run["prompt"]]) == len(prefix):
                    tokens, generate_tps = generate_from(target, tokenizer, drafter, snapshot, prefix, run["prompt"],
                                                         run["max_tokens"])
                else:
                    tokens, generate_tps = _cold(target, tokenizer, drafter, run)
                stats = served["stats"]
                rows.append({"served": served, "tokens": run["tokens"], "server_tps": stats.get("generation_tps", 0.0),
                             "generate_tokens": tokens, "generate_tps": generate_tps})
                print(f"  request {i + 1}: server {rows[-1]['server_tps']:.2f} tok/s, generate {generate_tps:.2f} "
                      f"tok/s, same tokens: {tokens == run['tokens']}", file=sys.stderr, flush=True)
            together: List[Any] = [None] * len(records)

            def one(i: int) -> None:
                with httpx.Client(timeout=httpx.Timeout(None)) as c:
                    together[i] = send(c, running.base, records[i])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(records))]
            tic = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            together_s = time.perf_counter() - tic
    finally:
        running.stop()
    print(report(rows, together, together_s))
    return 0


def _cold(target, tokenizer, drafter, run):
    """A prompt that does not extend the first one: stream_generate on the whole of it."""
    import mlx.core as mx

    from dflash_mlx import stream_generate

    tokens, last = [], None
    for response in stream_generate(target, tokenizer, mx.array(run["prompt"]), drafter, max_tokens=run["max_tokens"]):
        tokens.append(response.token)
        last = response
    return tokens, last.generation_tps


def report(rows, together, together_s) -> str:
    lines = ["| # | tokens | server alone tok/s | generate tok/s | server / generate | same tokens | "
             "all at once = alone |", "|---|---|---|---|---|---|---|"]
    server_s = generate_s = 0.0
    n_total = same_all = 0
    for i, (row, both) in enumerate(zip(rows, together), 1):
        n = len(row["tokens"])
        same = row["generate_tokens"] == row["tokens"]
        alike = both is not None and both["output"] == row["served"]["output"]
        same_all += alike
        if row["server_tps"] and row["generate_tps"]:
            server_s += n / row["server_tps"]
            generate_s += len(row["generate_tokens"]) / row["generate_tps"]
            n_total += n
        ratio = row["server_tps"] / row["generate_tps"] if row["generate_tps"] else 0.0
        lines.append(f"| {i} | {n} | {row['server_tps']:.2f} | {row['generate_tps']:.2f} | {ratio:.2f}x | "
                     f"{'yes' if same else 'NO'} | {'yes' if alike else 'NO'} |")
    generated = sum(len(r["generate_tokens"]) for r in rows)
    lines.append("")
    lines.append(f"decode over the session: server one at a time {n_total / server_s if server_s else 0:.2f} tok/s, "
                 f"generate {generated / generate_s if generate_s else 0:.2f} tok/s, server / generate "
                 f"**{(generated / generate_s) and (n_total / server_s) / (generated / generate_s):.3f}**")
    lines.append(f"all {len(rows)} at once: replies identical to alone {same_all}/{len(rows)} "
                 f"(wall {together_s:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
