"""Replay a recorded coding-agent session against `dflash-mlx serve`, with the package's defaults and with plain
decoding, side by side on the same target and weights, and report per request and in total: prompt tokens,
cached tokens, time to first token, decode tok/s, tau per draft source, and whether the replies are identical.

    python benchmarks/agent_session.py benchmarks/sessions/codex-stats-median [--model qwen2.5-coder-0.5b]

A session is a folder of requests as `tests/agents/recorder.py` writes them (NNN_POST_v1_responses.json,
NNN_POST_v1_messages.json, ...), recorded while a real client worked against the server. Each is sent again in
order, exactly as recorded (its history holds the replies of the recorded run, so both runs see the same
prompts); other routes (model lists, token counts, HEAD) are skipped. Both servers run at once on the one loaded
model and each request goes to both before the next (first to each in turn), so drift of the machine's speed
during the run weighs on both alike. Both start cold (empty prefix cache) and then keep their cache and planner
memory across the session's requests, as a server does for an agent. Greedy, as the agents
ask (no temperature). Figures come from each reply's `dflash` field (the server's own timings).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx

ROUTES = ("/v1/responses", "/v1/messages", "/v1/chat/completions")


def load_session(folder: Path) -> List[Dict[str, Any]]:
    """The session's generation requests in order; a missing folder or a file that is not a recorded request is
    one line (SystemExit) naming it, before any model is loaded."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"error: {folder}: no such session folder; give a folder of requests recorded by "
                         "tests/agents/recorder.py (e.g. benchmarks/sessions/codex-stats-median)")
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SystemExit(f"error: {path} is not a recorded request ({e}); record the session again or move "
                             "the file out of the folder") from None
        records.append(record)
    return [r for r in records if r.get("method") == "POST" and r.get("path") in ROUTES
            and isinstance(r.get("body"), dict)]


def _events(text: str):
    for block in text.split("\n\n"):
        data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if data and data[0] != "[DONE]":
            yield json.loads(data[0])


def reply_of(path: str, text: str) -> Dict[str, Any]:
    """(the reply's content and calls as one comparable value, the server's dflash stats) from a streamed reply."""
    output, stats = [], {}
    for event in _events(text):
        kind = event.get("type", "")
        if kind == "response.output_item.done":
            item = dict(event["item"])
            item.pop("id", None)
            item.pop("call_id", None)
            output.append(item)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            stats = event["response"].get("dflash") or {}
            stats["usage"] = event["response"].get("usage")
        elif kind == "content_block_delta":
            output.append(event["delta"])
        elif kind == "message_delta":
            stats = event.get("dflash") or {}
        elif "choices" in event:  # chat completions
            output.append(event["choices"][0].get("delta"))
            stats = event.get("dflash") or stats
    return {"output": output, "stats": stats}


def send(client: httpx.Client, base: str, record: Dict[str, Any]) -> Dict[str, Any]:
    """One recorded request, streamed, to the server at `base`: its reply, the server's stats and the wall time."""
    body = dict(record["body"], stream=True)
    query = f"?{record['query']}" if record.get("query") else ""
    tic = time.perf_counter()
    reply = client.post(base + record["path"] + query, json=body, headers=record.get("headers") or {})
    wall = time.perf_counter() - tic
    if reply.status_code != 200:
        raise SystemExit(f"{record['path']} answered {reply.status_code}: {reply.text[:300]}")
    result = reply_of(record["path"], reply.text)
    result["wall_s"] = wall
    return result


def replay(bases: Dict[str, str], records: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """The session's requests in order to every server, request by request: each request goes to all of them
    before the next one, first to each in turn, so that a machine that slows down or speeds up during the run
    weighs on every server alike (each server still sees the session in order, its prefix cache and planner
    memory carried from one request to the next)."""
    names = list(bases)
    results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    with httpx.Client(timeout=httpx.Timeout(None)) as client:
        for i, record in enumerate(records):
            for name in names[i % len(names):] + names[: i % len(names)]:
                result = send(client, bases[name], record)
                results[name].append(result)
                s = result["stats"]
                print(f"  {name} request {i + 1}: {s.get('prompt_tokens', '?')} prompt, "
                      f"{s.get('cached_tokens', 0)} cached, ttft {s.get('time_to_first_token_s', 0):.2f} s, "
                      f"{s.get('generation_tps', 0):.2f} tok/s", file=sys.stderr, flush=True)
    return results


def serve(model, tokenizer, drafter, plain: bool, max_tokens, tree_budget, cache_dir=None):
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread

    settings = ServerSettings(model_name="session", width=1 if plain else None, max_batch=1,
                              default_max_tokens=max_tokens, tree_budget=tree_budget,
                              prompt_cache_dir=str(cache_dir) if cache_dir else None)
    return start_in_thread(create_app(model, tokenizer, drafter, settings))


def taus(stats: Dict[str, Any]) -> str:
    parts = []
    for source, counts in sorted((stats.get("sources") or {}).items()):
        passes, tokens = (counts.get("passes", 0), counts.get("tokens", 0)) if isinstance(counts, dict) \
            else tuple(counts)
        if passes:
            parts.append(f"{source} {tokens / passes:.2f}x{passes}")
    return ", ".join(parts) or "-"


def report(records, fast, plain) -> str:
    lines = ["| # | prompt | cached | TTFT defaults / plain (s) | decode tok/s defaults / plain | speedup | "
             "tokens | τ per source (τ x passes) | identical |", "|---|---|---|---|---|---|---|---|---|"]
    totals = {"fast_tokens": 0, "fast_s": 0.0, "plain_s": 0.0, "same": 0}
    for i, (a, b) in enumerate(zip(fast, plain), 1):
        sa, sb = a["stats"], b["stats"]
        n = sa.get("completion_tokens", 0)
        ta, tb = sa.get("generation_tps", 0.0), sb.get("generation_tps", 0.0)
        same = a["output"] == b["output"]
        totals["same"] += same
        if ta and tb:
            totals["fast_tokens"] += n
            totals["fast_s"] += n / ta
            totals["plain_s"] += n / tb
        lines.append(f"| {i} | {sa.get('prompt_tokens')} | {sa.get('cached_tokens')} | "
                     f"{sa.get('time_to_first_token_s', 0):.2f} / {sb.get('time_to_first_token_s', 0):.2f} | "
                     f"{ta:.2f} / {tb:.2f} | {ta / tb if tb else 0:.2f}x | {n} | {taus(sa)} | {'yes' if same else 'NO'} |")
    speed = totals["plain_s"] / totals["fast_s"] if totals["fast_s"] else 0.0
    cold = fast[0]["stats"].get("time_to_first_token_s", 0.0)
    warm = [r["stats"].get("time_to_first_token_s", 0.0) for r in fast[1:]]
    lines.append("")
    lines.append(f"decode over the session: defaults {totals['fast_tokens'] / totals['fast_s'] if totals['fast_s'] else 0:.2f} "
                 f"tok/s, plain {totals['fast_tokens'] / totals['plain_s'] if totals['plain_s'] else 0:.2f} tok/s, "
                 f"**{speed:.2f}x**; replies identical {totals['same']}/{len(fast)}")
    if warm:
        mean_warm = sum(warm) / len(warm)
        lines.append(f"time to first token: cold {cold:.2f} s, warm turns {mean_warm:.2f} s on average "
                     f"({100 * mean_warm / cold if cold else 0:.0f}% of cold)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", type=Path, help="folder of recorded requests")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--max-tokens", type=int, default=None, help="limit replies whose request sets none "
                        "(Codex sets none: a looping reply could otherwise run to the end of the context)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table and raw figures here (JSON)")
    parser.add_argument("--tree-budget", default=None, help="the defaults' draft trees, as serve --tree-budget "
                        "(auto, off or a number; default: the server's default)")
    parser.add_argument("--prompt-cache-dir", type=Path, default=None, help="keep both servers' prefix caches "
                        "on disk here, as serve --prompt-cache-dir does: a rerun (and the plain server after the "
                        "first) starts from the stored prefills, so times to first token are then not cold; "
                        "decode figures are unaffected")
    args = parser.parse_args(argv)
    from dflash_mlx.cli_options import tree_budget_value
    from dflash_mlx.errors import DFlashError

    try:
        trees = tree_budget_value(args.tree_budget)
    except DFlashError as e:
        raise SystemExit(f"error: {e}")
    records = load_session(args.session)
    if not records:
        raise SystemExit(f"error: no recorded generation requests in {args.session} (files NNN_POST_v1_*.json as "
                         "tests/agents/recorder.py writes them)")
    from dflash_mlx import load

    model, tokenizer, drafter = load(args.model, args.draft)
    servers = {name: serve(model, tokenizer, drafter, plain, args.max_tokens, trees, args.prompt_cache_dir)
               for name, plain in (("defaults", False), ("plain", True))}
    print(f"{len(records)} requests, each to both servers in turn", file=sys.stderr, flush=True)
    try:
        runs = replay({name: running.base for name, running in servers.items()}, records)
    finally:
        for running in servers.values():
            running.stop()
    table = report(records, runs["defaults"], runs["plain"])
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
