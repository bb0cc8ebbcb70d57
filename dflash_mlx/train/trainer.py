"""The training loop: batches of anchored blocks from the feature cache, AdamW with warmup + cosine, checkpoints
that resume bit for bit, and held-out τ from the real decoding loop.

Reproducibility: the batch of step t is drawn from `np.random.default_rng([seed, t])`, and a checkpoint holds the
parameters, the optimizer state (moments, step) and the step, so a resumed run continues exactly as an
uninterrupted one. Nothing else is random (no dropout).
"""

from __future__ import annotations

import dataclasses
import json
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
from mlx.utils import tree_flatten, tree_unflatten

from ..drafter import DFlashDrafter
from ..errors import DFlashError
from .features import FeatureCache
from .forward import block_hidden
from .loss import block_loss, default_gamma, slot_weights
from .masks import sample_anchors

STATE_DIR = "train_state"


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    warmup: Optional[int] = None  # default: 5% of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    rows_per_step: int = 1
    anchors: int = 32
    gamma: Optional[float] = None  # default: default_gamma(block_size)
    kl: float = 0.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 200
    eval_tokens: int = 64

    def __post_init__(self):
        if self.warmup is None:
            self.warmup = max(1, self.steps // 20)
        if not 0 <= self.kl <= 1:
            raise DFlashError(f"--kl is a mixing weight between 0 and 1, got {self.kl}")
        if self.steps < 1 or self.anchors < 1 or self.rows_per_step < 1:
            raise DFlashError("--steps, --anchors and --rows must be positive")

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


class Trainer:
    """Trains a bound `DFlashDrafter` on a complete `FeatureCache`.

    With a reduced draft vocabulary, labels are mapped to draft ids through the drafter's `d2t`; labels outside
    it get no loss (the drafter could never propose them).
    """

    def __init__(self, drafter: DFlashDrafter, cache: FeatureCache, config: TrainConfig):
        if drafter.binding is None:
            raise RuntimeError("bind the drafter to its target before training")
        if cache.seq_len < drafter.block_size + 2:
            raise DFlashError(f"--seq-len {cache.seq_len} is too short for block size {drafter.block_size}")
        self.drafter = drafter
        self.cache = cache
        self.config = config
        self.t2d: Optional[np.ndarray] = None  # target id -> draft id (-1: none), for a reduced vocabulary
        self.block_size = drafter.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.gamma = config.gamma if config.gamma is not None else default_gamma(self.block_size)
        self.weights = mx.array(slot_weights(self.block_size, self.gamma))
        if "lm_head" in drafter:  # the reduced head keeps the target's rows; the id map is not a parameter
            drafter.freeze(keys=["lm_head", "d2t"], strict=False)
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(config), betas=[0.9, 0.95],
                                     weight_decay=config.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        self._features = cache.features()
        self._teacher = cache.teacher() if config.kl > 0 else None
        if config.kl > 0 and self._teacher is None:
            raise DFlashError("--kl needs the target's top-k in the feature cache; rebuild it with --kl-topk > 0")
        self._loss_and_grad = nn.value_and_grad(drafter, self._loss)
        self._vocab_changed()
        self.step = 0
        self.elapsed = 0.0
        self.context_tokens = 0  # row tokens read
        self.predicted = 0  # labelled block slots trained on
        self.history: List[Dict] = []  # held-out τ evaluations

    def _vocab_changed(self) -> None:
        if "lm_head" in self.drafter:
            from .vocab import maps

            N, V = self.drafter.config.draft_vocab_size, self.drafter.config.vocab_size
            self.t2d = maps(np.arange(N) + np.array(self.drafter.d2t), V)[1]

    # -- batches -------------------------------------------------------------------------------------------------
    def batch(self, step: int) -> Dict[str, mx.array]:
        """The blocks of training step `step` (a pure function of the seed and the step)."""
        cfg, B = self.config, self.block_size
        rng = np.random.default_rng([cfg.seed, step])
        rows, anchors = [], []
        for _ in range(100 * cfg.rows_per_step):
            row = int(rng.integers(self.cache.rows))
            a = sample_anchors(rng, np.asarray(self.cache.trainable[row]), cfg.anchors, B)
            if len(a):
                rows.append(row)
                anchors.append(a)
            if len(rows) == cfg.rows_per_step:
                break
        else:
            raise DFlashError("the data has (almost) no trainable tokens: no block can be placed")
        anchors = np.stack(anchors)  # [R, A]
        tokens = np.asarray(self.cache.tokens[rows]).astype(np.int32)  # [R, S]
        trainable = np.asarray(self.cache.trainable[rows])
        at = anchors[:, :, None] + np.arange(1, B)[None, None]  # [R, A, B-1]: positions slots 1..B-1 predict
        r = np.arange(len(rows))[:, None, None]
        labels, ok = tokens[r, at], trainable[r, at] > 0
        if self.t2d is not None:
            labels = self.t2d[labels]
            ok &= labels >= 0
        out = {
            "features": mx.array(np.asarray(self._features[rows]), dtype=mx.float32),
            "tokens": mx.array(tokens),
            "anchors": mx.array(anchors),
            "labels": mx.array(np.where(ok, labels, -1).astype(np.int32)),
        }
        if self._teacher is not None:
            ids = np.asarray(self._teacher[0][rows])[r, at - 1]  # the target's prediction for position a+k
            logp = np.asarray(self._teacher[1][rows])[r, at - 1]
            if self.t2d is not None:
                ids = self.t2d[ids]
            out["teacher_ids"] = mx.array(np.where(ok[..., None] & (ids >= 0), ids, -1).astype(np.int32))
            out["teacher_logp"] = mx.array(logp)
        return out

    # -- one step ----------------------------------------------------------------------------------------------------
    def _loss(self, batch: Dict[str, mx.array]):
        h = block_hidden(self.drafter, self.drafter.binding.embed, batch["features"], batch["tokens"],
                         batch["anchors"], self.mask_token_id)
        logits = self.drafter.draft_logits(h)
        return block_loss(logits, batch["labels"], self.weights, batch.get("teacher_ids"), batch.get("teacher_logp"),
                          self.config.kl)

    def loss(self, batch: Dict[str, mx.array]):
        return self._loss(batch)

    def train_step(self) -> Dict[str, float]:
        tic = time.perf_counter()
        batch = self.batch(self.step)
        (loss, stats), grads = self._loss_and_grad(batch)
        if self.config.grad_clip > 0:
            grads, norm = optim.clip_grad_norm(grads, self.config.grad_clip)
        else:
            norm = mx.array(0.0)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss, stats, norm)
        self.step += 1
        self.elapsed += time.perf_counter() - tic
        R, S = batch["tokens"].shape
        self.context_tokens += R * S
        self.predicted += int((batch["labels"] >= 0).sum().item())
        out = {k: v.item() for k, v in stats.items()}
        out.update(loss=loss.item(), grad_norm=norm.item(), lr=float(self.optimizer.learning_rate.item()))
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
                     predicted=self.predicted, history=self.history, config=self.config.to_dict(),
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
        self.step = int(state["step"])
        self.elapsed = float(state["elapsed"])
        self.context_tokens = int(state["context_tokens"])
        self.predicted = int(state["predicted"])
        self.history = list(state.get("history", []))
        return state


def latest_checkpoint(out: Path) -> Optional[Path]:
    file = Path(out) / STATE_DIR / "latest.json"
    if not file.is_file():
        return None
    return file.parent / json.loads(file.read_text())["dir"]


def held_out_tau(target, drafter, prompts: Sequence[Sequence[int]], *, max_tokens: int = 64,
                 stop_tokens: Sequence[int] = ()) -> Dict[str, float]:
    """Acceptance length τ = mean(accepted + 1) over the verify passes of greedy DFlash on `prompts`.

    `target` is a `TargetModel` tapped for `drafter` (see `api.prepare`); this is the engine's own loop.
    """
    from ..engine import dflash_generate_step

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
