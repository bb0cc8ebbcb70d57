"""The training loop: batches of anchored blocks from the feature cache, AdamW with warmup + cosine, gradient
accumulation to an effective batch of blocks, a compiled step, checkpoints that resume bit for bit, and held-out τ
from the real decoding loop.

One optimizer step = `accum` micro-batches of `rows_per_step` rows x `anchors` blocks. The target's features are
read from the cache (computed once, reused every epoch); anchors are drawn afresh for every micro-batch, so each
pass over the data trains on new blocks. A micro-batch is built with array operations only (per row, never per
slot) while the device still computes the previous one.

Reproducibility: micro-batch i of step t is drawn from `np.random.default_rng([seed, t, i])`, and a checkpoint
holds the parameters, the optimizer state (moments, step) and the step, so a resumed run continues exactly as an
uninterrupted one. Nothing else is random (no dropout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..drafters.dflash import DFlashDrafter
from ..errors import DFlashError
from .device import keep_freed_memory
from .features import FeatureCache
from .forward import block_hidden
from .loss import block_loss
from .recipe import block_labels, default_gamma, draw_blocks, label_positions, slot_weights
from .recipe import step_flops as recipe_step_flops

STATE_DIR = "train_state"
LABELS = ("data", "target")


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    warmup: Optional[int] = None  # default: 4% of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    rows_per_step: int = 1  # rows per micro-batch
    anchors: int = 32  # blocks per row
    batch_blocks: Optional[int] = None  # blocks per optimizer step (accumulated); None: one micro-batch
    gamma: Optional[float] = None  # default: default_gamma(block_size)
    kl: float = 0.0
    context_bands: int = 4  # anchors drawn in this many position groups, each with a shorter context (masks.py)
    labels: str = "data"  # "data": the next tokens of the text; "target": the target's own argmax there
    compile: bool = True
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 200
    eval_tokens: int = 64

    def __post_init__(self):
        if self.warmup is None:
            self.warmup = max(1, round(0.04 * self.steps))
        if not 0 <= self.kl <= 1:
            raise DFlashError(f"--kl is a mixing weight between 0 and 1, got {self.kl}")
        if self.steps < 1 or self.anchors < 1 or self.rows_per_step < 1:
            raise DFlashError("--steps, --anchors and --rows must be positive")
        if self.labels not in LABELS:
            raise DFlashError(f"--labels {self.labels!r} is not one of {', '.join(LABELS)}")

    @property
    def micro_blocks(self) -> int:
        return self.rows_per_step * self.anchors

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step."""
        return max(1, math.ceil((self.batch_blocks or 0) / self.micro_blocks))

    @classmethod
    def from_dict(cls, raw: Dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def lr_schedule(config: TrainConfig):
    warmup = min(config.warmup, config.steps - 1)
    decay = optim.cosine_decay(config.lr, max(config.steps - warmup, 1), config.lr * config.min_lr_ratio)
    if warmup <= 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(config.lr / warmup, config.lr, warmup), decay], [warmup])


def step_flops(drafter: DFlashDrafter, rows: int, anchors: int, seq_len: int) -> float:
    """Training FLOPs of one micro-batch (`recipe.step_flops`)."""
    return recipe_step_flops(drafter.config, rows, anchors, seq_len)


class Trainer:
    """Trains a bound `DFlashDrafter` on a complete `FeatureCache`.

    With a reduced draft vocabulary, labels are mapped to draft ids through the drafter's `d2t`; labels outside
    it get no loss (the drafter could never propose them). `device_features` keeps the whole feature cache in
    device memory (see `device.features_on_device`).
    """

    def __init__(self, drafter: DFlashDrafter, cache: FeatureCache, config: TrainConfig,
                 device_features: bool = False):
        if drafter.binding is None:
            raise RuntimeError("bind the drafter to its target before training")
        if cache.seq_len < drafter.block_size + 2:
            raise DFlashError(f"--seq-len {cache.seq_len} is too short for block size {drafter.block_size}")
        if mx.default_device().type == mx.cpu:
            keep_freed_memory()
        self.drafter = drafter
        self.cache = cache
        self.config = config
        self.t2d: Optional[np.ndarray] = None  # target id -> draft id (-1: none), for a reduced vocabulary
        self.block_size = drafter.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.gamma = config.gamma if config.gamma is not None else default_gamma(self.block_size)
        bands = max(1, config.context_bands)
        self.bands = bands if config.anchors % bands == 0 and cache.seq_len // bands > self.block_size else 1
        self.weights = mx.array(slot_weights(self.block_size, self.gamma))
        if "lm_head" in drafter:  # the reduced head keeps the target's rows; the id map is not a parameter
            drafter.freeze(keys=["lm_head", "d2t"], strict=False)
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(config), betas=[0.9, 0.95],
                                     weight_decay=config.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        features = cache.features()
        self.device_features = bool(device_features)
        self._features = mx.array(np.asarray(features)) if device_features else features
        self._argmax = None
        if config.labels == "target":
            self._argmax = cache.argmax()
            if self._argmax is None:
                raise DFlashError(f"feature cache '{cache.path}' predates --labels target (no argmax stored); "
                                  "delete it or pass another --cache")
        self._teacher = cache.teacher() if config.kl > 0 else None
        if config.kl > 0 and self._teacher is None:
            raise DFlashError("--kl needs the target's top-k in the feature cache; rebuild it with --kl-topk > 0")
        self._vocab_changed()
        self._build_steps()
        self.flops_per_micro = step_flops(drafter, config.rows_per_step, config.anchors, cache.seq_len)
        self.parallel = None  # a parallel.DataParallel once `join`ed
        self.step = 0
        self.elapsed = 0.0
        self.context_tokens = 0  # row tokens read
        self.predicted = 0  # labelled block slots trained on
        self.flops = 0.0  # training FLOPs spent (step_flops per micro-batch)
        self.history: List[Dict] = []  # held-out τ evaluations: step, slots, flops, tau, passes
        self.device = str(mx.default_device())
        self.backend = "cpu" if mx.default_device().type == mx.cpu else "gpu"

    def _vocab_changed(self) -> None:
        if "lm_head" in self.drafter:
            from .vocab import maps

            N, V = self.drafter.config.draft_vocab_size, self.drafter.config.vocab_size
            self.t2d = maps(np.arange(N) + np.array(self.drafter.d2t), V)[1]

    # -- batches -------------------------------------------------------------------------------------------------
    def batch(self, step: int, micro: int = 0) -> Dict[str, mx.array]:
        """Micro-batch `micro` of training step `step` (a pure function of the seed, the step and `micro`)."""
        cfg, B = self.config, self.block_size
        rng = np.random.default_rng([cfg.seed, step, micro])
        rows, anchors, bands = draw_blocks(rng, self.cache.rows, lambda row: self.cache.trainable[row],
                                           cfg.rows_per_step, cfg.anchors, B, self.bands)
        tokens = np.asarray(self.cache.tokens[rows]).astype(np.int32)  # [R, S]
        trainable = np.asarray(self.cache.trainable[rows])
        argmax = np.asarray(self._argmax[rows]) if self._argmax is not None else None
        labels = block_labels(tokens, trainable, anchors, B, argmax, self.t2d)
        ok = labels >= 0
        if self.device_features:
            features = mx.take(self._features, mx.array(np.asarray(rows, dtype=np.int32)), axis=0)
        else:
            features = mx.array(np.asarray(self._features[rows]))
        out = {
            "bands": bands,  # a Python int, not an array: which compiled step runs it
            "features": features,
            "tokens": mx.array(tokens),
            "anchors": mx.array(anchors),
            "labels": mx.array(labels),
        }
        if self._teacher is not None:
            r, at = np.arange(len(rows))[:, None, None], label_positions(anchors, B)
            ids = np.asarray(self._teacher[0][rows])[r, at - 1]  # the target's prediction for position a+k
            logp = np.asarray(self._teacher[1][rows])[r, at - 1]
            if self.t2d is not None:
                ids = self.t2d[ids]
            out["teacher_ids"] = mx.array(np.where(ok[..., None] & (ids >= 0), ids, -1).astype(np.int32))
            out["teacher_logp"] = mx.array(logp)
        return out

    # -- one step ----------------------------------------------------------------------------------------------------
    def _loss(self, batch: Dict[str, mx.array], bands: int = 1):
        h = block_hidden(self.drafter, self.drafter.binding.embed, batch["features"].astype(mx.float32),
                         batch["tokens"], batch["anchors"], self.mask_token_id, bands)
        logits = self.drafter.draft_logits(h)
        return block_loss(logits, batch["labels"], self.weights, batch.get("teacher_ids"), batch.get("teacher_logp"),
                          self.config.kl)

    def loss(self, batch: Dict[str, mx.array]):
        """(mean weighted loss, statistics) of one micro-batch, without gradients."""
        batch = dict(batch)
        return self._loss(batch, batch.pop("bands", 1))

    def _build_steps(self) -> None:
        """The two pieces of an optimizer step, compiled with the model and optimizer state as implicit inputs:
        `micro` (loss and weight-summed gradients of one micro-batch; one compiled variant per band count, picked
        by the batch's "bands") and `apply` (average, clip, AdamW)."""
        state = [self.drafter.state, self.optimizer.state]

        def micro_for(bands: int):
            def loss_sum(batch, total):
                # Gradients of the weight-summed loss add up across micro-batches; `apply` divides by the total.
                loss, stats = self._loss(batch, bands)
                return loss * total, (loss, stats)

            loss_and_grad = nn.value_and_grad(self.drafter, loss_sum)

            def micro(batch, total):
                (_, (loss, stats)), grads = loss_and_grad(batch, total)
                return loss, stats, grads

            # value_and_grad swaps parameters in: the state is an input and an output
            return mx.compile(micro, inputs=state, outputs=state) if self.config.compile else micro

        variants = {b: micro_for(b) for b in {1, self.bands}}

        def micro(batch, total):
            batch = dict(batch)
            return variants[batch.pop("bands", 1)](batch, total)

        def apply(grads, total):
            grads = tree_map(lambda g: g / mx.maximum(total, 1e-6), grads)
            if self.config.grad_clip > 0:
                grads, norm = optim.clip_grad_norm(grads, self.config.grad_clip)
            else:
                norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
            self.optimizer.update(self.drafter, grads)
            return norm

        if self.config.compile:
            apply = mx.compile(apply, inputs=state, outputs=state)
        self._micro, self._apply = micro, apply

    def join(self, parallel) -> None:
        """Train data-parallel with the other ranks of `parallel` (a `parallel.DataParallel`): every rank takes
        rank 0's weights and optimizer state now and computes its share of each step's micro-batches."""
        from .parallel import sync_state

        if parallel.size > self.config.accum:
            raise DFlashError(f"{parallel.size} ranks but only {self.config.accum} micro-batch(es) per step: raise "
                              f"--batch-blocks to at least {parallel.size * self.config.micro_blocks} or use fewer ranks")
        sync_state(self, parallel)
        self._build_steps()  # the compiled step holds the state objects it was built with
        self.parallel = parallel

    def train_step(self) -> Dict[str, float]:
        """One optimizer step over `config.accum` micro-batches (this rank's share of them when data-parallel);
        returns its statistics."""
        tic = time.perf_counter()
        accum = self.config.accum
        mine = self.parallel.share(accum) if self.parallel is not None else range(accum)
        grads = None
        totals, losses, stats_list = [], [], []
        weights = slot_weights(self.block_size, self.gamma)
        context = predicted = 0
        batch = self.batch(self.step, mine[0])
        for n, i in enumerate(mine):
            labels = np.asarray(batch["labels"])
            total = float((weights * (labels >= 0)).sum())  # the loss's normalizer, known on the host
            loss, stats, g = self._micro(batch, mx.array(total, dtype=mx.float32))
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.async_eval(grads, loss, stats)
            R, S = batch["tokens"].shape
            context += R * S
            predicted += int((labels >= 0).sum())
            if n + 1 < len(mine):  # build the next micro-batch on the host while the device computes this one
                batch = self.batch(self.step, mine[n + 1])
            totals.append(total)
            losses.append(loss)
            stats_list.append(stats)
        # Micro-batch statistics, weighted like the loss: sums here, divided by the summed weight below.
        keys = sorted(stats_list[0])
        sums = [sum(totals), sum(l.item() * w for l, w in zip(losses, totals))]
        sums += [sum(s[k].item() * w for s, w in zip(stats_list, totals)) for k in keys]
        if self.parallel is not None:
            grads = self.parallel.sum(grads)
            sums = self.parallel.sum(mx.array(sums, dtype=mx.float32)).tolist()
            context, predicted = self.parallel.sum(mx.array([context, predicted], dtype=mx.int32)).tolist()
        norm = self._apply(grads, mx.array(sums[0], dtype=mx.float32))
        mx.eval(self.drafter.parameters(), self.optimizer.state, norm)
        self.step += 1
        self.context_tokens += context
        self.predicted += predicted
        self.flops += accum * self.flops_per_micro
        self.elapsed += time.perf_counter() - tic
        wsum = max(sums[0], 1e-6)
        out = {k: v / wsum for k, v in zip(keys, sums[2:])}
        out.update(loss=sums[1] / wsum, grad_norm=norm.item(), lr=float(self.optimizer.learning_rate.item()))
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def save(self, out: Path, extra: Optional[Dict] = None) -> Path:
        """Write train_state/step-N/{params,optimizer}.safetensors + trainer.json, then point latest.json at it."""
        root = Path(out) / STATE_DIR
        step_dir = root / f"step-{self.step}"
        tmp = root / f".step-{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "params.safetensors"), dict(tree_flatten(self.drafter.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        state = dict(step=self.step, elapsed=self.elapsed, context_tokens=self.context_tokens,
                     predicted=self.predicted, flops=self.flops, history=self.history, config=self.config.to_dict(),
                     drafter_config=self.drafter.config.to_dict(), **(extra or {}))
        (tmp / "trainer.json").write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        shutil.rmtree(step_dir, ignore_errors=True)
        os.replace(tmp, step_dir)
        latest = root / "latest.json"
        (root / "latest.json.tmp").write_text(json.dumps({"step": self.step, "dir": step_dir.name}) + "\n")
        os.replace(root / "latest.json.tmp", latest)
        for old in root.glob("step-*"):
            if old != step_dir:
                shutil.rmtree(old, ignore_errors=True)
        return step_dir

    def load(self, step_dir: Path) -> Dict:
        """Restore parameters, optimizer state, step and counters from a `save` directory; returns trainer.json."""
        step_dir = Path(step_dir)
        state = json.loads((step_dir / "trainer.json").read_text())
        params = mx.load(str(step_dir / "params.safetensors"))
        self.drafter.load_weights(list(params.items()), strict=True)
        opt_state = mx.load(str(step_dir / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(opt_state.items()))
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        self._vocab_changed()
        self._build_steps()  # the compiled step holds the state objects it was built with
        self.step = int(state["step"])
        self.elapsed = float(state["elapsed"])
        self.context_tokens = int(state["context_tokens"])
        self.predicted = int(state["predicted"])
        self.flops = float(state.get("flops", 0.0))
        self.history = list(state.get("history", []))
        return state


def latest_checkpoint(out: Path) -> Optional[Path]:
    """The step folder train_state/latest.json points at, or None before the first checkpoint."""
    file = Path(out) / STATE_DIR / "latest.json"
    if not file.is_file():
        return None
    try:
        step_dir = file.parent / json.loads(file.read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"'{file}' is damaged ({type(e).__name__}); restore the run's train_state/ from a "
                          "copy, or start a new run in another --out") from None
    if not (step_dir / "trainer.json").is_file():
        raise DFlashError(f"'{file}' points at {step_dir.name}, which holds no trainer.json; restore the run's "
                          "train_state/ from a copy, or start a new run in another --out")
    return step_dir


def held_out_tau(target, drafter, prompts: Sequence[Sequence[int]], *, max_tokens: int = 64,
                 stop_tokens: Sequence[int] = ()) -> Dict[str, float]:
    """Acceptance length τ = mean(accepted + 1) over the verify passes of greedy DFlash on `prompts`.

    `target` is a `TargetModel` tapped for `drafter` (see `api.prepare`); this is the engine's own loop.
    """
    from ..decode.loop import dflash_generate_step

    total, passes, tokens = 0, 0, 0
    tic = time.perf_counter()
    for prompt in prompts:
        for cycle in dflash_generate_step(mx.array(list(prompt), dtype=mx.int32), target, drafter,
                                          max_tokens=max_tokens, stop_tokens=stop_tokens):
            tokens += len(cycle.tokens)
            if not cycle.is_prefill:
                total += cycle.accepted + 1
                passes += 1
    return {"tau": total / max(passes, 1), "passes": passes, "tokens": tokens,
            "seconds": time.perf_counter() - tic}
