"""Let a target answer a prompt file itself, within a time budget: target-answered training data for a drafter.

Reads prompts (`.jsonl` records with `prompt`, `messages` or ShareGPT `conversations`; only the turns before the
first assistant turn are kept), has the target answer them greedily in batches (mlx-lm's `batch_generate`, through
the trainer's own `regenerate`), and writes `{"prompt": ..., "response": ...}` records as it goes, so a run stopped
by `--minutes` keeps every finished batch. `dflash-mlx train --data ANSWERS.jsonl` trains on the answers (with
`--labels target` the labels are the target's own argmax along them).

    python examples/answer_prompts.py --target qwen2.5-coder-0.5b --prompts prompts.jsonl --out answers.jsonl \\
        --max-tokens 320 --batch 128 --minutes 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="mlx-lm folder or offline model name")
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-tokens", type=int, default=320, help="longest answer, in tokens")
    parser.add_argument("--batch", type=int, default=64, help="prompts decoded together")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting new batches after this long")
    args = parser.parse_args(argv)

    from dflash_mlx.models.loading import load_target, resolve_target
    from dflash_mlx.train.data import eos_id, prompt_chats, regenerate, write_answers

    model, tokenizer = load_target(resolve_target(args.target))
    chats = prompt_chats(tokenizer, args.prompts)
    eos = eos_id(tokenizer)

    def answer(docs):
        answered = regenerate(model, tokenizer, docs, max_tokens=args.max_tokens, batch_size=args.batch,
                              progress=False)
        return [[t for t, keep in zip(d.tokens, d.trainable) if keep and t != eos] for d in answered]

    tic = time.perf_counter()
    written, tokens = write_answers(chats, answer, tokenizer.decode, args.out, batch=args.batch, minutes=args.minutes,
                                    log=lambda line: print(line, flush=True))
    print(f"wrote {written} answers ({tokens} tokens) to {args.out} in {time.perf_counter() - tic:.0f} s")


if __name__ == "__main__":
    main()
