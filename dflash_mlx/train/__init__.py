"""Training DFlash drafters: `dflash-mlx train` (command.py) and its parts.

data.py      files and chat datasets -> packed token rows, label mask, held-out prompts (optionally regenerated)
features.py  the frozen target's tapped features, extracted once into a resumable memory-mapped cache
masks.py     anchor sampling and the block attention mask
forward.py   the drafter's masked training forward over many blocks at once (its own modules and weights)
loss.py      slot-weighted cross-entropy (+ the target's top-k distribution), acceptance statistics
vocab.py     reduced draft vocabulary (d2t) and its head
trainer.py   AdamW + warmup/cosine, exact-resume checkpoints, held-out τ with the real decoding loop
"""

from .forward import block_hidden
from .loss import block_loss, default_gamma, slot_weights
from .masks import block_mask, sample_anchors
from .trainer import TrainConfig, Trainer, held_out_tau

__all__ = ["block_hidden", "block_loss", "block_mask", "default_gamma", "held_out_tau", "sample_anchors",
           "slot_weights", "TrainConfig", "Trainer"]
