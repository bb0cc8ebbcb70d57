"""Short replies through the server's engine: does a request pay for probing when its planner starts cold?

A coding agent's requests are often a few dozen tokens long (a tool call, a one-line answer). A planner that
starts from nothing probes: a wide first pass, every tree budget once, lookup against the drafter; over 40 tokens
that can cost more than speculation saves. The server now keeps what its planners measured
(`decode.memory.PlannerMemory`) and seeds each request with it.

This runs the same short prompts through the server's generation path (`server.generation.Generator`, no HTTP)
three ways, side by side on one loaded target, rotating their order per prompt:
- plain: `width=1`, plain decoding through the same code;
- cold: the defaults with the memory forgotten before every request (what every request got before);
- warm: the defaults, the memory kept from request to request (what the server does now).
It prints each request's decode tok/s and speedup over plain, the totals, and whether every reply is identical.

    python benchmarks/short_replies.py [--model qwen2.5-coder-0.5b] [--max-tokens 48] [--prompts 8]
"""

from __future__ import annotations

import argparse
import sys
import time

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Rename the variable `x` to `count` in: for x in range(10): total += x",
    "What does `git rebase -i HEAD~3` do? One sentence.",
    "Write a Python one-liner that reverses a string s.",
    "Add a type hint to: def mean(values): return sum(values) / len(values)",
    "Write a shell command that counts the lines of every .py file in a folder.",
    "Fix the bug: def last(xs): return xs[len(xs)]",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a docstring for: def clamp(x, lo, hi): return max(lo, min(x, hi))",
    "Write a Python function that flattens a nested list.",
    "Convert to a list comprehension: out = []\nfor v in vals:\n    if v > 0:\n        out.append(v * 2)",
    "Write a Python function that counts the vowels in a string.",
]


def run_one(generator, ids, max_tokens):
    from dflash_mlx.server.generation import GenerationRequest, Outcome

    tokens, outcome = [], None
    for event in generator.run(GenerationRequest(prompt=list(ids), max_tokens=max_tokens)):
        if isinstance(event, Outcome):
            outcome = event
        else:
            tokens.extend(getattr(event, "tokens", []))
    stats = outcome.stats
    n = outcome.completion_tokens
    tps = stats.get("generation_tps", 0.0)
    return tokens, n, (n / tps if tps else float("nan"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.server.generation import Generator

    model, tokenizer, drafter = load(args.model, args.draft)
    plain = Generator(model, tokenizer, drafter, width=1, prompt_cache_bytes=0)
    cold = Generator(model, tokenizer, drafter, prompt_cache_bytes=0)
    warm = Generator(model, tokenizer, drafter, prompt_cache_bytes=0)
    runs = {"plain": plain, "cold": cold, "warm": warm}
    prompts = PROMPTS[: args.prompts]
    totals = {k: [0, 0.0] for k in runs}
    same = 0
    print("| # | tokens | plain tok/s | cold tok/s (x plain) | warm tok/s (x plain) | identical |")
    print("|---|---|---|---|---|---|")
    for i, text in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        order = list(runs)[i % 3:] + list(runs)[: i % 3]
        out = {}
        for name in order:
            if name == "cold":
                cold.memory.forget()
            out[name] = run_one(runs[name], ids, args.max_tokens)
        rate = {k: (n / s if s == s and s > 0 else 0.0) for k, (_, n, s) in out.items()}
        for k, (_, n, s) in out.items():
            totals[k][0] += n
            totals[k][1] += s
        identical = out["plain"][0] == out["cold"][0] == out["warm"][0]
        same += identical
        print(f"| {i + 1} | {out['plain'][1]} | {rate['plain']:.2f} | {rate['cold']:.2f} "
              f"({rate['cold'] / rate['plain']:.2f}x) | {rate['warm']:.2f} ({rate['warm'] / rate['plain']:.2f}x) "
              f"| {'yes' if identical else 'NO'} |", flush=True)
    tps = {k: n / s for k, (n, s) in totals.items()}
    print(f"\ntotal decode: plain {tps['plain']:.2f} tok/s, cold {tps['cold']:.2f} ({tps['cold'] / tps['plain']:.2f}x), "
          f"warm {tps['warm']:.2f} ({tps['warm'] / tps['plain']:.2f}x); replies identical {same}/{len(prompts)}")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
