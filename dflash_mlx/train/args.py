"""The options of one training run (`TrainArgs`): what `dflash-mlx train` was asked for, saved with every checkpoint
and read back on `--resume` (`saved_args`)."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import DFlashError
from .trainer import TrainConfig


@dataclass
class TrainArgs:
    """Everything `dflash-mlx train` was asked for; stored with each checkpoint so `--resume` needs no other flags
    than --target and --out (which win over the saved ones)."""

    target: str
    out: str
    data: List[str] = field(default_factory=list)
    cache: Optional[str] = None  # default: OUT/features
    steps: int = TrainConfig.steps
    lr: float = TrainConfig.lr
    warmup: Optional[int] = None  # default: 4% of the steps
    weight_decay: float = TrainConfig.weight_decay
    grad_clip: float = TrainConfig.grad_clip
    block_size: int = 16
    num_layers: int = 5
    target_layers: Optional[List[int]] = None
    intermediate_size: Optional[int] = None
    anchors: int = 128
    rows: int = 1
    batch_blocks: int = 512
    labels: str = "data"
    seq_len: int = 512
    gamma: Optional[float] = None
    kl: float = 0.0
    kl_topk: Optional[int] = None  # default: 8 with --kl, else 0 (the target's logits are then never computed)
    draft_vocab: Optional[int] = None
    mask_token_id: Optional[int] = None
    max_data_tokens: Optional[int] = None
    regenerate: int = 0
    gen_batch: int = 16
    eval_prompts: int = 4
    eval_every: int = 200
    eval_tokens: int = 64
    checkpoint_every: int = 200
    seed: int = 0
    dtype: str = "fp32"
    compile: bool = True
    max_minutes: Optional[float] = None  # stop (checkpointed, resumable) after this much training time
    progress: bool = True

    def train_config(self):
        return TrainConfig(steps=self.steps, lr=self.lr, warmup=self.warmup, weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, rows_per_step=self.rows, anchors=self.anchors,
                           batch_blocks=self.batch_blocks, gamma=self.gamma, kl=self.kl, labels=self.labels,
                           compile=self.compile, seed=self.seed, checkpoint_every=self.checkpoint_every,
                           eval_every=self.eval_every, eval_tokens=self.eval_tokens)

    def command_line(self) -> str:
        """The `dflash-mlx train` invocation of these options (defaults left out)."""
        parts = ["dflash-mlx", "train"]
        defaults = TrainArgs(target="", out="")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("progress", "max_minutes") or (
                    f.name not in ("target", "out") and value == getattr(defaults, f.name)):
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "data":
                parts += [x for v in value for x in ("--data", shlex.quote(v))]
            elif isinstance(value, list):
                parts += [flag, ",".join(map(str, value))]
            elif isinstance(value, bool):
                parts += [flag if value else "--no-" + flag[2:]]
            else:
                parts += [flag, shlex.quote(str(value))]
        return " ".join(parts)

    def __post_init__(self):
        if self.kl_topk is None:
            self.kl_topk = 8 if self.kl > 0 else 0
        if self.kl > 0 and self.kl_topk <= 0:
            raise DFlashError("--kl needs --kl-topk > 0")

    @property
    def cache_dir(self) -> Path:
        return Path(self.cache) if self.cache else Path(self.out) / "features"


def saved_args(raw: Dict, overrides: Dict) -> TrainArgs:
    """The options a checkpoint was trained with (older runs: their implicit defaults), with `overrides`."""
    raw = dict(raw)
    if "batch_blocks" not in raw:  # a run from before gradient accumulation: one micro-batch per step
        raw["batch_blocks"] = raw.get("rows", 1) * raw.get("anchors", 32)
        if raw.get("warmup") is None:
            raw["warmup"] = max(1, raw.get("steps", 2000) // 20)
    return TrainArgs(**dict(raw, **{k: v for k, v in overrides.items() if v is not None}))
