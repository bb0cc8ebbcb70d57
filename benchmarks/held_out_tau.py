"""Held-out acceptance of a drafter: τ = mean(accepted + 1) over the verify passes of greedy DFlash at the
drafter's block size (every pass verifies the whole block: no adaptive width), with the engine's own loop.

Prompts: a chat-record file (`.jsonl`: `prompt` / `messages` records, rendered with the target's chat template) or
a JSON list of token-id lists (the `eval_prompts.json` a training run writes).

    python benchmarks/held_out_tau.py --target qwen2.5-coder-0.5b --drafter DIR --prompts heldout_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List


def read_prompts(path: Path, tokenizer) -> List[List[int]]:
    from dflash_mlx.train.data import prompt_chats

    if path.suffix == ".json":
        return [list(map(int, p)) for p in json.loads(path.read_text())]
    return [doc.prompt for _, doc in prompt_chats(tokenizer, path)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="offline model name or mlx-lm folder")
    p.add_argument("--drafter", required=True, nargs="+", help="drafter folder(s), each measured on the same prompts")
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    from dflash_mlx import DFlashError, load
    from dflash_mlx.models.loading import prepare
    from dflash_mlx.train.data import eos_id
    from dflash_mlx.train.trainer import held_out_tau

    try:
        for drafter_dir in args.drafter:
            model, tokenizer, drafter = load(args.target, drafter=drafter_dir)
            prompts = read_prompts(args.prompts, tokenizer)
            r = held_out_tau(prepare(model, drafter), drafter, prompts, max_tokens=args.max_tokens,
                             stop_tokens=[eos_id(tokenizer)])
            print(f"{drafter_dir}: tau {r['tau']:.3f} at B={drafter.block_size} over {r['passes']} verify passes, "
                  f"{r['tokens']} tokens, {len(prompts)} prompts x {args.max_tokens} ({r['seconds']:.0f} s)")
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
