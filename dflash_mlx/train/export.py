"""What a run writes into --out as it trains and when it ends: checkpoints with what `--resume` needs
(`save_checkpoint`), then the drafter as `convert` writes it and its model card (`write_drafter`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..dtypes import dtype_name
from .args import TrainArgs
from .outdir import claim_out


def save_checkpoint(out: Path, args: TrainArgs, trainer) -> None:
    """A checkpoint in OUT/train_state: the trainer's state plus the options, their command line and the target's
    fingerprint, so `--resume` needs only --target and --out and refuses another target."""
    claim_out(out)
    trainer.save(out, {"args": dataclasses.asdict(args), "command": args.command_line(),
                       "target_identity": getattr(trainer, "target_identity", None)})


def write_drafter(out: Path, args: TrainArgs, drafter, trainer, cache, extraction) -> None:
    """The loadable drafter (`config.json` + `model.safetensors` in the --dtype asked for) and its README.md card."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..drafters.io import build_drafter, save_drafter
    from .card import write_card

    export = build_drafter(drafter.config)  # a copy to cast: the checkpoint keeps float32
    export.load_weights(list(tree_flatten(drafter.parameters())))
    export.set_dtype(getattr(mx, dtype_name(args.dtype)))
    save_drafter(export, out)
    write_card(out, args, drafter.config, trainer, cache, extraction)
