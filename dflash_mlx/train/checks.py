"""Checking a run's options: each mistake refused in one line before anything loads (`check_options`), and the
ones that need the target's depth and vocabulary right after it loads (`check_target_options`)."""

from __future__ import annotations

import math

from ..errors import DFlashError
from .args import TrainArgs
from .trainer import LABELS


def _positive(value) -> bool:
    """A finite number above 0 (nan and inf fail)."""
    return value is not None and math.isfinite(value) and value > 0


def check_options(args: TrainArgs) -> None:
    """Refuse options that cannot train, in one line each, before anything loads or is written.

    (The tapped layers need the target's depth: `check_target_options` checks them once it is loaded.)
    """
    def bad(flag: str, want: str, value) -> DFlashError:
        return DFlashError(f"{flag} must be {want}, got {value}")

    counts = dict(steps=args.steps, num_layers=args.num_layers, anchors=args.anchors, rows=args.rows,
                  batch_blocks=args.batch_blocks, gen_batch=args.gen_batch, eval_tokens=args.eval_tokens)
    for name, value in counts.items():
        if value < 1:
            raise bad("--" + name.replace("_", "-"), "at least 1", value)
    if args.block_size < 2:
        raise bad("--block-size", "at least 2 for training (a given token and at least one drafted)",
                  args.block_size)
    if args.seq_len < args.block_size + 2:  # a row holds at least one context token, a block and its label
        raise bad("--seq-len", f"at least --block-size + 2 = {args.block_size + 2} tokens", args.seq_len)
    if not _positive(args.lr):
        raise bad("--lr", "a positive finite number", args.lr)
    if args.gamma is not None and not _positive(args.gamma):
        raise bad("--gamma", "a positive finite number", args.gamma)
    if not 0 <= args.kl <= 1:  # nan fails too
        raise bad("--kl", "a mixing weight between 0 and 1", args.kl)
    if args.labels not in LABELS:
        raise DFlashError(f"--labels {args.labels!r} is not one of {', '.join(LABELS)}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise bad("--max-minutes", "a positive number of minutes", args.max_minutes)
    # 0 means "off" for these (the loop tests them for truth): only negatives are mistakes.
    for flag, value, zero in (("--checkpoint-every", args.checkpoint_every, "only at the end"),
                              ("--eval-every", args.eval_every, "only at the end"),
                              ("--regenerate", args.regenerate, "train on the data as is"),
                              ("--eval-prompts", args.eval_prompts, "no held-out τ"),
                              ("--kl-topk", args.kl_topk, "none cached"),
                              ("--warmup", args.warmup, "no warmup")):
        if value is not None and value < 0:
            raise bad(flag, f"0 ({zero}) or more", value)
    for flag, value in (("--weight-decay", args.weight_decay), ("--grad-clip", args.grad_clip)):
        if not (math.isfinite(value) and value >= 0):
            raise bad(flag, "a finite number, 0 or more", value)
    for flag, value in (("--draft-vocab", args.draft_vocab), ("--intermediate-size", args.intermediate_size),
                        ("--max-data-tokens", args.max_data_tokens)):
        if value is not None and value < 1:
            raise bad(flag, "a positive number", value)
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise bad("--mask-token-id", "a token id (0 or more)", args.mask_token_id)


def check_target_options(args: TrainArgs, target) -> None:
    """The options that need the loaded target: tapped layers, mask token and draft vocabulary within its range."""
    n, V = target.num_layers, target.vocab_size
    if args.target_layers:
        wrong = [t for t in args.target_layers if not 0 <= t < n]
        if wrong:
            raise DFlashError(f"--target-layers {','.join(map(str, args.target_layers))}: the target has {n} "
                              f"layers (0..{n - 1}), so {','.join(map(str, wrong))} is out of range")
    if args.mask_token_id is not None and args.mask_token_id >= V:
        raise DFlashError(f"--mask-token-id {args.mask_token_id} is outside the target's vocabulary of {V} tokens")
    if args.draft_vocab is not None and args.draft_vocab > V:
        raise DFlashError(f"--draft-vocab {args.draft_vocab} is larger than the target's vocabulary of {V} tokens")
