"""`python -m dflash_mlx.torch_train.answer`: the target answers prompts (greedy, batched, in PyTorch).

The recipe trains on the target's own answers. This writes them as chat records, one
`{"messages": [..., {"role": "assistant", "content": ...}]}` per line, the format `examples/answer_prompts.py`
writes with MLX and both trainers read. Prompts are any records `dflash_mlx.train.data` reads (`messages`,
`conversations`, `prompt`); a record's first assistant turn and what follows are dropped and answered anew.
`--minutes` stops starting new batches after that long, so a run fits a time budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch

from ..errors import exit_code
from ..train.data import eos_id, prompt_chats, write_answers
from .target import load_torch_target, pick_device


def answer_batch(target, prompts: List[List[int]], max_tokens: int) -> List[List[int]]:
    """Greedy answers (token ids, up to and without EOS) to `prompts`, decoded together with left padding."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_id(tok)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    with torch.no_grad():
        out = target.model.generate(input_ids=ids.to(target.device), attention_mask=attention.to(target.device),
                                    max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    eos = set(target.eos)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_mlx.torch_train.answer", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="Hugging Face / mlx-lm model folder, or a .gguf file")
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--max-tokens", type=int, default=320, help="longest answer, in tokens")
    p.add_argument("--batch", type=int, default=128, help="prompts decoded together")
    p.add_argument("--minutes", type=float, default=None, help="stop starting new batches after this long")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    return exit_code(lambda: _answer(args))


def _answer(args) -> int:
    device = pick_device(args.device)
    target = load_torch_target(args.target, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tok = target.tokenizer
    chats = prompt_chats(tok, args.prompts)
    chats.sort(key=lambda c: len(c[1].prompt))  # similar lengths together: less padding
    write_answers(chats, lambda docs: answer_batch(target, [d.prompt for d in docs], args.max_tokens),
                  tok.decode, args.out, batch=args.batch, minutes=args.minutes,
                  log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
