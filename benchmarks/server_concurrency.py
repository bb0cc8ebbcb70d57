"""Several clients against one server: do concurrent requests share verify passes, and does each reply stay exact?

Starts `dflash-mlx serve`'s app on 127.0.0.1 with the given pair (default: qwen2.5-coder-0.5b and its shipped
drafter), sends each prompt alone (one client), then all of them at once (N clients), greedy, and checks that every
concurrent reply equals its reply alone. Prints decode tok/s for one client alone and the aggregate for N
concurrent clients, and their ratio.

    python benchmarks/server_concurrency.py                        # 4 clients, 64 tokens each
    python benchmarks/server_concurrency.py --clients 8 --max-tokens 128 --max-batch 8

Decode time excludes the prefill: a reply's decode seconds are its completion tokens over the server's
`dflash.generation_tps`, and its first token came that long before its end. The aggregate is all concurrent
replies' tokens over the span from the earliest first token to the last end (joiners' prefills fall inside it).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that computes the greatest common divisor of two integers.",
]


def ask(base: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=3600)
    r.raise_for_status()
    end = time.perf_counter()
    reply = r.json()
    tokens = reply["usage"]["completion_tokens"]
    tps = reply["dflash"]["generation_tps"]
    seconds = tokens / tps if tps else float("nan")
    return {"text": reply["choices"][0]["message"]["content"], "tokens": tokens, "decode_s": seconds,
            "first": end - seconds, "end": end, "widths": reply["dflash"]["verify_widths"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=None, help="default: --clients")
    args = parser.parse_args()
    if not 1 <= args.clients <= len(PROMPTS):
        parser.error(f"--clients must be 1..{len(PROMPTS)}")

    from dflash_mlx import load
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread

    model, tokenizer, drafter = load(args.model, args.draft)
    settings = ServerSettings(model_name="bench", max_batch=args.max_batch or args.clients, prompt_cache_bytes=0)
    app = create_app(model, tokenizer, drafter, settings)
    running = start_in_thread(app)
    prompts = PROMPTS[: args.clients]
    try:
        ask(running.base, "Say hi.", 4)  # warm-up
        alone = [ask(running.base, p, args.max_tokens) for p in prompts]
        results = [None] * len(prompts)

        def client(i):
            results[i] = ask(running.base, prompts[i], args.max_tokens)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        running.stop()

    same = [a["text"] == c["text"] for a, c in zip(alone, results)]
    one = sum(a["tokens"] for a in alone) / sum(a["decode_s"] for a in alone)
    span = max(c["end"] for c in results) - min(c["first"] for c in results)
    many = sum(c["tokens"] for c in results) / span
    sizes = dict(sorted(app.state.server.generator.batch.sizes.items())) if app.state.server.generator.batch else {}
    print(f"model {args.model}, {args.clients} clients, {args.max_tokens} max tokens, greedy")
    for i, (a, c) in enumerate(zip(alone, results)):
        print(f"  client {i}: {a['tokens']} tokens, alone {a['tokens'] / a['decode_s']:.2f} tok/s, "
              f"widths alone {a['widths']}, concurrent {c['widths']}, identical: {same[i]}")
    print(f"one client alone     : {one:.2f} tok/s decode")
    print(f"{args.clients} concurrent clients: {many:.2f} tok/s decode (aggregate)")
    print(f"ratio                : {many / one:.2f}x")
    print(f"members per batched pass (pass count): {sizes}")
    print(f"outputs identical to alone: {sum(same)}/{len(same)}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
