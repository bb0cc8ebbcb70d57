"""`dflash-mlx train`: make a DFlash drafter for an mlx-lm target, from data to a loadable drafter directory.

    dflash-mlx train --target smollm2-135m --data ~/code/ --out my-drafter --steps 2000

This module is the typer command alone: its flags become a `TrainArgs` (args.py) handed to `launch.run`.

Defaults follow the public DFlash recipe (see `recipe_rows` in card.py): 5 draft layers tapping target layers spread
from 1 to L-3 ([1, 6, 11, 16, 21] on a 24-layer target), block 16 with γ 7, 128 anchors per 512-token row,
gradient accumulation to 512 blocks per optimizer step, AdamW lr 6e-4 with 4% warmup and cosine decay, clip 1.0;
the target's embedding and head are borrowed, never trained. Training runs on MLX's default device (an Apple or
NVIDIA GPU when the installed MLX has one, see device.py).

Stages, each resumable: (1) read and pack the data (optionally the target answers every prompt); (2) run the
frozen target once over it and cache the tapped features on disk (prepare.py); (3) train (loop.py: checkpoints,
`--resume`); (4) write the drafter (`config.json` + `model.safetensors`, as `convert` writes) and a model card
README.md into --out (export.py). session.py sets a run up, launch.py runs it in one or several processes.

Safety: every option is checked before the target loads (checks.py; the tapped layers right after it loads).
--out must be new, empty, or a run of ours (outdir.py): a run marks its --out (`RUN_MARKER`) before its first
write there, and never writes into a folder holding a model or files it did not make. `--resume` continues in the
--out given, with the --target given, after checking that it is the model the run was trained on (target.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..dtypes import dtype_name
from ..errors import DFlashError
from .args import TrainArgs
from .launch import run


def _ints(text: Optional[str]) -> Optional[List[int]]:
    """--target-layers "1,9,17" as [1, 9, 17] (None when not given)."""
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"--target-layers takes comma-separated integers, got {text!r}") from None


def train_command(
    target: str = typer.Option(..., "--target", "-t", help="Target: local mlx-lm dir, offline "
                                             "model name (see 'dflash-mlx models') or hub repo id."),
    data: Optional[List[str]] = typer.Option(None, "--data", help="Training data: files, directories "
                                                           "or globs (text/code, or .jsonl chats); repeatable."),
    out: Path = typer.Option(..., "--out", "-o", help="Output drafter directory."),
    cache: Optional[Path] = typer.Option(None, "--cache", help="Feature cache dir (default OUT/features)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default 2000; with "
                                                    "--resume: extend or shorten the saved run)."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, warmup + cosine)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Warmup steps (default 4% of --steps)."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Clip the gradient norm (0: off)."),
    block_size: int = typer.Option(16, "--block-size", help="Block size B."),
    num_layers: int = typer.Option(5, "--num-layers", help="Draft layers (also the number of taps)."),
    target_layers: Optional[str] = typer.Option(None, "--target-layers", help="Tapped target layers, "
                                                              "e.g. 1,9,17 (default: spread evenly)."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="Draft MLP "
                                                                  "width (default: the target's)."),
    anchors: int = typer.Option(128, "--anchors", help="Blocks (random anchors) per row."),
    rows: int = typer.Option(1, "--rows", help="Rows (packed sequences) per micro-batch."),
    batch_blocks: int = typer.Option(512, "--batch-blocks", help="Blocks per optimizer step "
                                                 "(gradient accumulation over micro-batches)."),
    labels: str = typer.Option("data", "--labels", help="Slot labels: 'data' (the text's next tokens) "
                                           "or 'target' (the target's own argmax there: no --regenerate needed)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per row (context length trained on)."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Slot weight decay γ (default 7 for "
                                                        "B=16, 5 for 10, 4 for 8)."),
    kl: float = typer.Option(0.0, "--kl", help="Weight of the target's top-k distribution in the "
                                           "loss (0..1; rest: cross-entropy on the data)."),
    kl_topk: Optional[int] = typer.Option(None, "--kl-topk", help="Target top-k cached per token (default 8 with "
                                          "--kl, else 0)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="Reduced draft "
                                                            "vocabulary: the N most frequent tokens of the data."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Mask token (default: "
                                                              "an unused special token)."),
    max_data_tokens: Optional[int] = typer.Option(None, "--max-data-tokens", help="Read at most "
                                                                "this many tokens of data."),
    regenerate: int = typer.Option(0, "--regenerate", help="Let the target answer every prompt "
                                                 "itself, up to N tokens (0: train on the data as is)."),
    gen_batch: int = typer.Option(16, "--gen-batch", help="Prompts per batch for --regenerate."),
    eval_prompts: int = typer.Option(4, "--eval-prompts", help="Held-out documents for τ."),
    eval_every: int = typer.Option(200, "--eval-every", help="Measure held-out τ every N steps."),
    eval_tokens: int = typer.Option(64, "--eval-tokens", help="New tokens per held-out prompt."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", help="Checkpoint every N steps."),
    seed: int = typer.Option(0, "--seed", help="Seed for data order, anchors and initialization."),
    dtype: str = typer.Option("fp32", "--dtype", help="Saved drafter dtype: fp32, bf16, fp16."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="Compile the training step."),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Stop after this much "
                                                              "training (checkpointed; continue with --resume)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out (its saved "
                                              "options apply; --target must be the model it was trained on)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Training processes on this machine, "
                                          "each computing a share of every step (data parallel). Default: one per "
                                          "CPU core when training on the CPU (as memory allows), 1 on a GPU."),
):
    """Train a DFlash drafter for a target: cache its features once, then train (resumable)."""
    dtype_name(dtype)  # a bad --dtype fails before anything loads
    args = TrainArgs(target=target, out=str(out), data=list(data or []), cache=str(cache) if cache else None,
                     steps=TrainArgs.steps if steps is None else steps, lr=lr, warmup=warmup, grad_clip=grad_clip,
                     block_size=block_size, num_layers=num_layers, target_layers=_ints(target_layers),
                     intermediate_size=intermediate_size, anchors=anchors, rows=rows, batch_blocks=batch_blocks,
                     labels=labels, seq_len=seq_len, gamma=gamma, kl=kl, kl_topk=kl_topk, draft_vocab=draft_vocab,
                     mask_token_id=mask_token_id, max_data_tokens=max_data_tokens, regenerate=regenerate,
                     gen_batch=gen_batch, eval_prompts=eval_prompts, eval_every=eval_every, eval_tokens=eval_tokens,
                     checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, compile=compile)
    run(args, resume=resume, steps=steps, max_minutes=max_minutes, workers=workers)
