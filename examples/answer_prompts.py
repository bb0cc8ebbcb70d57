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
import json
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

    from dflash_mlx.loading import load_target, resolve_target
    from dflash_mlx.train.data import eos_id, prompt_chats, regenerate

    model, tokenizer = load_target(resolve_target(args.target))
    chats = prompt_chats(tokenizer, args.prompts)
    eos = eos_id(tokenizer)
    tic, written, tokens = time.perf_counter(), 0, 0
    with args.out.open("w") as f:
        for begin in range(0, len(chats), args.batch):
            if args.minutes is not None and time.perf_counter() - tic > 60 * args.minutes:
                break
            batch = chats[begin : begin + args.batch]
            answered = regenerate(model, tokenizer, [doc for _, doc in batch], max_tokens=args.max_tokens,
                                  batch_size=args.batch, progress=False)
            for (messages, _), doc in zip(batch, answered):
                answer = [t for t, keep in zip(doc.tokens, doc.trainable) if keep and t != eos]
                reply = {"role": "assistant", "content": tokenizer.decode(answer)}
                f.write(json.dumps({"messages": messages + [reply]}) + "\n")
                written, tokens = written + 1, tokens + len(answer)
            f.flush()
            seconds = time.perf_counter() - tic
            print(f"{written}/{len(chats)} answered, {tokens} tokens, {tokens / seconds:.0f} tok/s", flush=True)
    print(f"wrote {written} answers ({tokens} tokens) to {args.out} in {time.perf_counter() - tic:.0f} s")


if __name__ == "__main__":
    main()
