"""Setting up a run (`setup_run`): the checks, the target, the feature cache, the drafter bound to the target and
the trainer, restored from the latest checkpoint on `--resume`. Everything `launch.run` needs before training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from ..errors import DFlashError
from .args import TrainArgs, saved_args
from .checks import check_options, check_target_options
from .drafter import build_training_drafter
from .outdir import check_cache_dir, check_out, inside
from .prepare import prepare_cache
from .recipe import default_taps
from .target import check_resumed_target, load_training_target, target_identity


def setup_run(args: TrainArgs, resume: bool, log, overrides: Optional[Dict] = None):
    """Target, feature cache, bound drafter and trainer (restored from the latest checkpoint with `resume`).

    Returns (args, tokenizer, target, drafter, trainer, cache, extraction): `args` as the run goes on (with
    `resume`: the saved options), `target` bound to the drafter, `extraction` the feature extraction's stats (None
    when the cache was already complete)."""
    from ..api import prepare
    from ..targets import build_target
    from .device import features_on_device, pick_device
    from .trainer import Trainer, latest_checkpoint

    out = Path(args.out)
    check_out(out)
    checkpoint = latest_checkpoint(out)
    saved, given = None, args
    if checkpoint is not None and not resume:
        raise DFlashError(f"'{out}' holds a training run (step {checkpoint.name[5:]}); pass --resume to continue "
                          "it or choose another --out")
    if resume:
        if checkpoint is None:
            raise DFlashError(f"nothing to resume in '{out}' (no checkpoint yet); run the same command without "
                              "--resume: an interrupted feature extraction continues by itself")
        saved = json.loads((checkpoint / "trainer.json").read_text())
        # The saved options apply, but the paths given win: the run continues in the --out given (a copy of a run
        # must never write into the original), with the --target given (checked below to be the trained model).
        args = saved_args(saved["args"], dict(overrides or {}, progress=args.progress, target=given.target,
                                              out=given.out, cache=given.cache))
        check_options(args)
        log(f"resuming {checkpoint} (step {saved['step']} of {args.steps}) with its saved options")
    if args.cache:
        check_cache_dir(args.cache_dir)

    model, tokenizer, target_ref = load_training_target(args.target)
    target = build_target(model)
    identity = target_identity(model)
    check_target_options(args, target)
    args.target_layers = list(args.target_layers or default_taps(target.num_layers, args.num_layers))
    cache_ref, writable = target_ref, True
    if saved is not None:
        cache_ref = check_resumed_target(saved, given.target, target, identity, args, target_ref)
        # A cache outside --out that this command did not name is only read: a resume writes only into --out.
        writable = given.cache is not None or inside(args.cache_dir, out)
    cache, extraction = prepare_cache(args, model, tokenizer, target, cache_ref, args.target_layers, log,
                                      writable=writable)
    drafter = build_training_drafter(args, model, tokenizer, target, cache, saved)
    target = prepare(model, drafter)  # checks the pair, taps the drafter's layers, binds embedding and head
    choice = pick_device()
    nbytes = cache.rows * cache.seq_len * cache.feature_dim * 2
    resident = features_on_device(nbytes, choice)
    log(f"device: {choice.describe()}; feature cache {nbytes / 2 ** 30:.2f} GiB "
        f"{'kept on the device' if resident else 'memory-mapped on the host'}")
    trainer = Trainer(drafter, cache, args.train_config(), device_features=resident)
    trainer.device = choice.describe()
    trainer.target_identity = identity  # saved with each checkpoint: a resume checks its --target against it
    if checkpoint is not None:
        trainer.load(checkpoint)
    return args, tokenizer, target, drafter, trainer, cache, extraction

