"""Training DFlash drafters: `dflash-mlx train` (command.py) and its parts.

command.py   the typer command: flags -> TrainArgs -> launch.run
args.py      TrainArgs, the run's options (saved with every checkpoint, read back on --resume)
checks.py    every option checked in one line before anything loads (and against the loaded target)
outdir.py    where a run may write: --out and --cache checks, the run marker
target.py    loading the target for training, its fingerprint, the --resume target check
prepare.py   data -> feature cache for a run (stages 1 and 2), fingerprinted
drafter.py   the drafter a run starts from: config, output norm gain, mask token, reduced head
session.py   one run set up: target, cache, drafter and trainer (restored on --resume)
launch.py    run: in-process, --workers ranks on this machine, or a rank under mlx.launch
loop.py      the training loop: steps, held-out τ, checkpoints, the summary lines
export.py    checkpoints and the written drafter + model card
data.py      files and chat datasets -> packed token rows, label mask, held-out prompts (optionally regenerated)
features.py  the frozen target's tapped features, extracted once into a resumable memory-mapped cache
recipe.py    rows, anchors, labels, slot weights, taps and mask token: numpy only, shared with torch_train
masks.py     the block attention mask
forward.py   the drafter's masked training forward over many blocks at once (its own modules and weights)
loss.py      slot-weighted cross-entropy (+ the target's top-k distribution), acceptance statistics
vocab.py     reduced draft vocabulary (d2t) and its head
trainer.py   AdamW + warmup/cosine, exact-resume checkpoints, held-out τ with the real decoding loop
"""

# The MLX parts load on first use, so the numpy-only modules (data, recipe, card) import without MLX
# (`dflash_mlx.torch_train` runs on machines that have only PyTorch).
_EXPORTS = {"block_hidden": "forward", "block_loss": "loss", "block_mask": "masks", "default_gamma": "recipe",
            "held_out_tau": "trainer", "sample_anchors": "recipe", "slot_weights": "recipe", "TrainConfig": "trainer",
            "Trainer": "trainer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
