"""`python -m dflash_mlx.torch_train`: train a DFlash drafter in PyTorch (an NVIDIA GPU, or any torch device).

The recipe is `dflash-mlx train`'s, shared in code where it can be (`dflash_mlx.train.data` reads and packs the
data, `dflash_mlx.train.recipe` draws rows, anchors and labels from the same seed and weighs the slots): frozen
target, embedding and head; drafter layers, `fc` and norms trained with AdamW (betas 0.9/0.95, weight decay 0.01),
warmup (4% of steps) then cosine to 10% of the peak rate, gradients clipped at 1.0, slot-weighted cross-entropy on
the target's own greedy choices (`--labels target`) or the text's tokens. What differs: the target's features are
computed on the fly for every micro-batch (a GPU does that faster than it reads a cache), and the held-out
figure printed while training is the block acceptance on held-out rows; the real τ comes from the engine, after
`dflash-mlx convert`, on the held-out prompts saved as `eval_prompts.json`.

The output folder is a z-lab-layout drafter (`checkpoint.py`) plus `train_state.pt` (weights, optimizer, step) for
`--resume`, `log.jsonl` and `train_args.json`. Needs torch, transformers, safetensors, numpy (not MLX).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from ..errors import DFlashError, exit_code
from ..train.data import eos_id, prepare_data
from ..train.recipe import (block_labels, choose_mask_token, default_taps, draw_blocks, drafter_config, slot_weights,
                                step_flops)
from ..train.vocab import maps, select_vocab
from .checkpoint import load_drafter, save_drafter
from .model import DraftModel
from .target import describe, load_torch_target, pick_device

STATE_NAME = "train_state.pt"
EVAL_STREAM = 2 ** 31  # the held-out draws' "step": the same blocks at every evaluation
UNTIL_RESERVE_S = 5  # --until: seconds kept after the last step for its evaluation and the save


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_mlx.torch_train", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="Hugging Face / mlx-lm model folder, or a .gguf file")
    p.add_argument("--data", action="append", default=[], help="text/code files, folders or .jsonl chats (repeat)")
    p.add_argument("--out", required=True, type=Path, help="output folder (the drafter, its state and log)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--init", type=Path, default=None, help="start from this drafter's weights (a new schedule)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (or --minutes)")
    p.add_argument("--minutes", type=float, default=None,
                   help="fill this many minutes: time a few steps first, then fix --steps and the schedule")
    p.add_argument("--until", type=float, default=None,
                   help="fill the time until this Unix time (like --minutes, counted from when the steps start, "
                        "so loading the target and the data eats into it); the run stops and saves by then")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--target-layers", type=str, default=None, help="tapped target layers, e.g. 1,11,21")
    p.add_argument("--draft-vocab", type=int, default=None, help="reduced draft vocabulary (most frequent labels)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--labels", choices=("data", "target"), default="target")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--anchors", type=int, default=128, help="blocks per row")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=None, help="slot-weight decay (default: the recipe's for B)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out documents (their prompts: eval_prompts.json)")
    p.add_argument("--eval-rows", type=int, default=8, help="held-out rows for the block acceptance printed")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--max-data-tokens", type=int, default=None)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the drafter file's dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda when present)")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter's training forward")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps is None and args.minutes is None and args.until is None and not args.resume:
        p.error("give --steps, --minutes or --until")
    if args.block_size < 2 or args.num_layers < 1 or args.rows < 1 or args.anchors < 1 or args.accum < 1:
        p.error("--block-size must be at least 2; --num-layers, --rows, --anchors and --accum positive")
    if args.seq_len < args.block_size + 2:
        p.error(f"--seq-len {args.seq_len} is too short for block size {args.block_size}")
    return args


def lr_at(step: int, steps: int, lr: float, min_ratio: float, warmup: Optional[int] = None) -> float:
    """Linear warmup over 4% of the steps (or `warmup`), then cosine from `lr` to `lr * min_ratio` (the MLX
    trainer's schedule)."""
    warmup = min(max(1, round(0.04 * steps)) if warmup is None else warmup, steps - 1)
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(steps - warmup, 1))
    return lr * min_ratio + (lr - lr * min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


REPLAN_EVERY = 10  # steps between two re-estimates of a time-filling run's length


def replan_steps(done: int, steps: int, spent_s: float, left_s: float) -> int:
    """A time-filling run's total steps at the pace measured so far: `done` steps took `spent_s` seconds of wall
    time (evaluations and checkpoints included) and `left_s` remain. The first calibration times a few bare steps,
    which can be a third too fast on a GPU; without this the schedule stops before its floor."""
    if done < REPLAN_EVERY or spent_s <= 0:
        return steps
    return done + max(1, int(left_s * done / spent_s))


class Run:
    """One training run: data, target, drafter, optimizer and the step loop."""

    def __init__(self, args: argparse.Namespace, log=print):
        self.args, self.log = args, log
        self.device = pick_device(args.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.target = load_torch_target(args.target, self.device, dtype)
        data = prepare_data(self.target.tokenizer, args.data, seq_len=args.seq_len, max_tokens=args.max_data_tokens,
                            num_eval=args.eval_prompts, seed=args.seed, progress=False)
        rows = data.tokens.shape[0]
        held = min(args.eval_rows, rows // 10)
        self.tokens, self.trainable = data.tokens[: rows - held], data.trainable[: rows - held]
        self.eval_tokens, self.eval_trainable = data.tokens[rows - held:], data.trainable[rows - held:]
        self.eval_prompts = data.eval_prompts
        log(f"data: {data.summary['documents']} documents, {rows} rows of {args.seq_len} ({held} held out), "
            f"{int(self.trainable.sum())} trainable tokens; {len(data.eval_prompts)} held-out prompts")
        self.argmax = self._eval_argmax = None
        if args.labels == "target":
            tic = time.perf_counter()
            self.argmax = self.target.argmax_rows(self.tokens, progress=sys.stderr.isatty())
            log(f"target labels: {self.tokens.size} tokens in {time.perf_counter() - tic:.1f} s")
        self.model, self.config = self._build_drafter()
        self.target.taps = list(self.config.target_layer_ids)
        self.t2d = maps(np.arange(len(self.d2t)) + self.d2t, self.config.vocab_size)[1] if self.d2t is not None else None
        self.weights = torch.tensor(slot_weights(args.block_size, args.gamma), device=self.device)
        self.forward = torch.compile(self.model.block_hidden) if args.compile else self.model.block_hidden
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=args.lr,
                                           betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.step, self.slots, self.elapsed, self.steps = 0, 0, 0.0, args.steps
        self.warmup: Optional[int] = None  # fixed once a time-filling run is calibrated (its length is re-planned)
        self.flops = 0.0

    # -- setup ------------------------------------------------------------------------------------------------------
    def _build_drafter(self):
        args, target = self.args, self.target
        source = args.out if args.resume else args.init
        if source is not None:
            model = load_drafter(source)
            config = model.config
        else:
            mask = args.mask_token_id
            if mask is None:
                emb = target.model.get_input_embeddings().weight
                mask = choose_mask_token(target.tokenizer, target.vocab_size, self.tokens,
                                         lambda i: bool(emb[i].abs().sum() > 0), reserved=[eos_id(target.tokenizer)])
            taps = [int(x) for x in args.target_layers.split(",")] if args.target_layers else \
                default_taps(target.num_layers, args.num_layers)
            config = drafter_config(target.config, hidden_size=target.hidden_size,
                                    num_target_layers=target.num_layers, vocab_size=target.vocab_size,
                                    num_layers=args.num_layers, block_size=args.block_size, mask_token_id=mask,
                                    taps=taps, intermediate_size=args.intermediate_size, draft_vocab=args.draft_vocab)
            torch.manual_seed(args.seed)
            model = DraftModel(config)
            gain = target.output_gain()
            if gain is not None:
                model.norm.weight.data.copy_(gain)
            if config.draft_vocab_size:
                labels, keep = self.tokens, self.trainable
                if self.argmax is not None:  # argmax[p] labels position p + 1
                    labels, keep = self.argmax[:, :-1], self.trainable[:, 1:]
                ids = select_vocab(labels, keep, config.draft_vocab_size, config.vocab_size,
                                   always=target.eos or [eos_id(target.tokenizer)])  # every id that ends an answer
                model.d2t.copy_(torch.as_tensor(maps(ids, config.vocab_size)[0]))
                model.lm_head.weight.data.copy_(target.head_rows(ids))
        self.d2t = model.d2t.numpy().astype(np.int64) if config.draft_vocab_size else None
        return model.to(self.device), config

    # -- batches and steps ------------------------------------------------------------------------------------------
    def batch(self, step: int, micro: int, tokens=None, trainable=None, argmax=None) -> Dict[str, torch.Tensor]:
        """Micro-batch `micro` of step `step`: the MLX trainer's draw (`recipe.draw_blocks`, uniform anchors)."""
        a = self.args
        tokens = self.tokens if tokens is None else tokens
        trainable = self.trainable if trainable is None else trainable
        argmax = self.argmax if argmax is None and tokens is self.tokens else argmax
        rng = np.random.default_rng([a.seed, step, micro])
        rows, anchors, _ = draw_blocks(rng, len(tokens), lambda r: trainable[r], a.rows, a.anchors, a.block_size, 1)
        row_tokens = tokens[rows].astype(np.int64)
        labels = block_labels(row_tokens, trainable[rows], anchors, a.block_size,
                              argmax[rows] if argmax is not None else None, self.t2d)
        dev = self.device
        return {"tokens": torch.as_tensor(row_tokens, device=dev), "anchors": torch.as_tensor(anchors, device=dev).long(),
                "labels": torch.as_tensor(labels, device=dev).long()}

    def loss(self, batch: Dict[str, torch.Tensor]):
        """(weighted mean cross-entropy, slot-1 accuracy, block τ) of one micro-batch."""
        features = self.target.features(batch["tokens"])
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            h = self.forward(features, batch["tokens"], batch["anchors"], self.target.embed)
            logits = self.model.logits(h, self.target.head).float()
        labels = batch["labels"]
        valid = labels >= 0
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.clamp(min=0).flatten(),
                                               reduction="none").view(labels.shape)
        w = self.weights * valid
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        correct = (logits.argmax(-1) == labels) & valid
        acc1 = correct[..., 0].sum() / valid[..., 0].sum().clamp(min=1)
        tau = 1 + torch.cumprod(correct.float(), dim=-1).sum(-1).mean()
        return loss, acc1.detach(), tau.detach(), int(valid.sum())

    def train_step(self) -> Dict[str, float]:
        a = self.args
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.steps, a.lr, a.min_lr_ratio, self.warmup)
        self.optimizer.zero_grad(set_to_none=True)
        stats = np.zeros(3)
        for micro in range(a.accum):
            loss, acc1, tau, n = self.loss(self.batch(self.step, micro))
            (loss / a.accum).backward()
            stats += [loss.item(), acc1.item(), tau.item()]
            self.slots += n
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], a.grad_clip)
        self.optimizer.step()
        self.step += 1
        loss, acc1, tau = stats / a.accum
        return dict(step=self.step, loss=loss, acc1=acc1, tau=tau, grad_norm=float(norm),
                    lr=self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self, batches: int = 4) -> Dict[str, float]:
        """Block acceptance on held-out rows (fixed draws): what a greedy verify would accept of those blocks."""
        if not len(self.eval_tokens):
            return {}
        if self.argmax is not None and self._eval_argmax is None:  # the held-out rows' labels: once per run
            self._eval_argmax = self.target.argmax_rows(self.eval_tokens)
        argmax = self._eval_argmax
        out = np.zeros(3)
        for i in range(batches):
            b = self.batch(EVAL_STREAM, i, self.eval_tokens, self.eval_trainable, argmax)
            loss, acc1, tau, _ = self.loss(b)
            out += [loss.item(), acc1.item(), tau.item()]
        loss, acc1, tau = out / batches
        return dict(step=self.step, eval_loss=loss, eval_acc1=acc1, eval_tau=tau)

    # -- time-filling runs ------------------------------------------------------------------------------------------
    def calibrate(self, minutes: float, probe: int = 6) -> int:
        """Steps that fill `minutes`: time `probe` steps on a copy of the drafter and optimizer (then dropped)."""
        model, optimizer, step, slots = copy.deepcopy(self.model), copy.deepcopy(self.optimizer.state_dict()), \
            self.step, self.slots
        self.steps = max(self.steps or 0, 100)
        times = []
        for _ in range(probe):
            tic = time.perf_counter()
            self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - tic)
        self.model.load_state_dict(model.state_dict())
        self.optimizer.load_state_dict(optimizer)
        self.step, self.slots = step, slots
        per_step = float(np.median(times[2:] if probe > 3 else times))
        # Evaluations and checkpoints take a few percent on top of the steps.
        steps = max(1, int(0.95 * minutes * 60 / per_step))
        self.log(f"calibration: {per_step:.3f} s/step -> {steps} steps for {minutes:g} min")
        return steps

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def save(self) -> None:
        a = self.args
        dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        save_drafter(self.model, a.out, dtype, metadata={"trained_with": "dflash_mlx.torch_train"})
        state = dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(), step=self.step,
                     steps=self.steps, slots=self.slots, elapsed=self.elapsed, flops=self.flops,
                     warmup=self.warmup)
        torch.save(state, a.out / (STATE_NAME + ".tmp"))
        (a.out / (STATE_NAME + ".tmp")).replace(a.out / STATE_NAME)
        (a.out / "eval_prompts.json").write_text(json.dumps(self.eval_prompts) + "\n")

    def restore(self) -> None:
        state = torch.load(self.args.out / STATE_NAME, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.slots, self.elapsed = state["step"], state["slots"], state["elapsed"]
        self.flops = state.get("flops", 0.0)
        self.warmup = state.get("warmup")
        self.steps = self.args.steps or state["steps"]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: _train(args, lambda line: print(line, flush=True)))


def _train(args, log) -> int:
    # Checked before anything is loaded; --out is made once the run has started (a failed start leaves none).
    if args.out.exists() and not args.out.is_dir():
        raise DFlashError(f"--out '{args.out}' is a file; pass a folder for the run")
    if not args.resume and (args.out / STATE_NAME).exists():
        raise DFlashError(f"'{args.out}' holds a run already; pass --resume to continue it or another --out")
    if args.resume and not (args.out / STATE_NAME).is_file():
        raise DFlashError(f"nothing to resume: '{args.out / STATE_NAME}' does not exist")
    run = Run(args, log)
    log(f"device: {describe(run.device)}; drafter {run.config.num_hidden_layers} layers, taps "
        f"{run.config.target_layer_ids}, mask {run.config.mask_token_id}, vocab "
        f"{run.config.draft_vocab_size or run.config.vocab_size}, "
        f"{sum(p.numel() for p in run.model.parameters() if p.requires_grad) / 1e6:.1f} M trained parameters")
    if args.resume:
        run.restore()
        log(f"resumed at step {run.step} of {run.steps}")
    elif args.steps is None:
        minutes = args.minutes if args.until is None else (args.until - time.time()) / 60
        if minutes <= 0:
            raise DFlashError(f"--until is {-60 * minutes:.0f} s in the past once the target and data are loaded")
        # With --until the steps must end UNTIL_RESERVE_S early (the last evaluation and the save come after).
        run.steps = run.calibrate(minutes if args.until is None else max(minutes - UNTIL_RESERVE_S / 60, 1 / 600))
        run.warmup = max(1, round(0.04 * run.steps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_args.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items()}, indent=1) + "\n")
    flops = step_flops(run.config, args.rows, args.anchors, args.seq_len) * args.accum
    deadline = time.perf_counter() + 60 * args.minutes * 1.05 if args.minutes else None
    if args.until is not None:  # a hard end: the last step, its evaluation and the save fit before it
        deadline = time.perf_counter() + (args.until - time.time()) - UNTIL_RESERVE_S
    # A time-filling run re-plans its length as it goes, so that the schedule reaches its floor at the end.
    end = None if args.steps is not None or args.resume else \
        (deadline if args.until is not None else time.perf_counter() + 60 * args.minutes)
    history = open(args.out / "log.jsonl", "a")
    tic, first = time.perf_counter(), run.step
    while run.step < run.steps:
        t0 = time.perf_counter()
        stats = run.train_step()
        run.elapsed += time.perf_counter() - t0
        run.flops += flops
        done = run.step == run.steps or (deadline is not None and time.perf_counter() > deadline)
        if run.step % 10 == 0 or done:
            rate = run.slots / max(run.elapsed, 1e-9)
            log(f"step {run.step}/{run.steps} loss {stats['loss']:.3f} acc1 {stats['acc1']:.3f} "
                f"tau {stats['tau']:.2f} lr {stats['lr']:.2e} | {rate:.0f} slots/s, "
                f"{run.flops / max(run.elapsed, 1e-9) / 1e12:.2f} TFLOP/s")
            history.write(json.dumps(dict(stats, slots=run.slots, flops=run.flops, seconds=run.elapsed)) + "\n")
        if (args.eval_every and run.step % args.eval_every == 0) or done:
            ev = run.evaluate()
            if ev:
                log(f"held-out rows: loss {ev['eval_loss']:.3f} acc1 {ev['eval_acc1']:.3f} "
                    f"block tau {ev['eval_tau']:.2f}")
                history.write(json.dumps(dict(ev, slots=run.slots, flops=run.flops)) + "\n")
        if (args.checkpoint_every and run.step % args.checkpoint_every == 0) or done:
            run.save()
        history.flush()
        if done:
            break
        if end is not None and (run.step - first) % REPLAN_EVERY == 0:
            now = time.perf_counter()
            steps = replan_steps(run.step - first, run.steps - first, now - tic, end - now) + first
            if steps != run.steps and (run.step - first) % (10 * REPLAN_EVERY) == 0:
                log(f"re-planned: {steps} steps at {(now - tic) / (run.step - first):.3f} s/step")
            run.steps = max(steps, run.step + 1)
    log(f"done: {run.step} steps, {run.slots} predicted slots, {run.flops:.3g} training FLOPs, "
        f"{time.perf_counter() - tic:.0f} s; drafter in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
