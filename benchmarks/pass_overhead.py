"""What the decode loop's host code costs per verify pass: DFlash at a fixed width (the same passes on every run,
so only the loop's own overhead can differ) against mlx-lm's plain decoding, side by side on one target.

Uses only the public API (`load`, `stream_generate`), so the same script measures any checkout of the package:
run it with each checkout first on `PYTHONPATH`, alternating, and compare the ratios.

    python benchmarks/pass_overhead.py                    # the default pair, 4 HumanEval-style prompts
    python benchmarks/pass_overhead.py --width 4 --rounds 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(text: str) -> bool:\n    \"\"\"Whether text reads the same backwards, ignoring case.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def word_counts(text):\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry or offline name, or a folder")
    p.add_argument("--width", type=int, default=4, help="fixed verify width of the DFlash runs")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds over the prompts (plain and DFlash alternate)")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.generate import stream_generate as mlx_lm_stream

    import dflash_mlx
    from dflash_mlx import load, stream_generate

    model, tokenizer, drafter = load(args.model)
    # The fixed width goes by the name each checkout knows (newer: width=, older: block_size=).
    fixed = "width" if "proposer" in stream_generate.__code__.co_varnames else "block_size"

    def dflash(prompt):
        return [r.token for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=args.max_tokens,
                                                 lookup=False, **{fixed: args.width})]

    def plain(prompt):
        return [r.token for r in mlx_lm_stream(model, tokenizer, prompt, max_tokens=args.max_tokens)]

    dflash(PROMPTS[0][:20]), plain(PROMPTS[0][:20])  # warm-up
    seconds = {"mlx-lm": 0.0, "dflash": 0.0}
    tokens = {"mlx-lm": 0, "dflash": 0}
    same = 0
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            outs = {}
            for name, run in (("mlx-lm", plain), ("dflash", dflash)):
                mx.synchronize()
                tic = time.perf_counter()
                outs[name] = run(prompt)
                seconds[name] += time.perf_counter() - tic
                tokens[name] += len(outs[name])
            same += outs["mlx-lm"] == outs["dflash"]
    rate = {k: tokens[k] / seconds[k] for k in seconds}
    print(f"dflash_mlx {dflash_mlx.__file__}")
    print(f"mlx-lm plain {rate['mlx-lm']:.2f} tok/s | DFlash width {args.width} {rate['dflash']:.2f} tok/s | "
          f"ratio {rate['dflash'] / rate['mlx-lm']:.3f}x | identical {same}/{args.rounds * len(PROMPTS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
