"""Running a run (`run`): in this process, as data-parallel ranks it starts on this machine (--workers), or as one
rank of an `mlx.launch` group. Options are checked first; the setup (`session.setup_run`) and the training loop
(`loop.train_loop`) do the work."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ..errors import DFlashError
from .args import TrainArgs
from .checks import check_options
from .loop import train_loop
from .session import setup_run


def run(args: TrainArgs, *, resume: bool = False, log=print, steps: Optional[int] = None,
        max_minutes: Optional[float] = None, workers: Optional[int] = None, announce: bool = True) -> Path:
    """Train a drafter as `args` says; returns the output directory (a loadable drafter).

    With `resume`, the run's saved options apply; `steps` and `max_minutes` (if given) replace the saved ones, so a
    bounded run can be continued and extended session after session. The paths given win: the run continues in
    `args.out` (a copy of a run never touches the original) with `args.target`, which must be the trained model.
    With `workers` > 1 (None: one per CPU core when training on the CPU, see `parallel.default_workers`) this
    process prepares the data and the feature cache, then starts that many ranks on this machine to train
    data-parallel and waits for them. Under `mlx.launch` every rank runs this; rank 0 prepares first, evaluates and
    writes. `announce=False` keeps the setup lines quiet.
    """
    from mlx.utils import tree_flatten

    from ..distributed.group import launched, rank0_first, setup
    from .parallel import LocalWorkers, default_workers

    overrides = dict(steps=steps, max_minutes=max_minutes)
    # Every option is checked before anything loads (with --resume: the given ones, and the saved ones later).
    check_options(dataclasses.replace(args, **{k: v for k, v in overrides.items() if v is not None}))
    if not resume:
        args = dataclasses.replace(args, **{k: v for k, v in overrides.items() if v is not None})
    quiet = log if announce else (lambda *a: None)
    if launched():
        if workers is not None and workers > 1:
            raise DFlashError("--workers starts ranks on this machine; under mlx.launch leave it out (every "
                              "launched rank trains)")
        group = setup()
        with rank0_first(group):  # rank 0 reads the data and builds the feature cache before the others open it
            state = setup_run(args, resume, quiet, overrides)
        return train_loop(state, log, group)
    state = setup_run(args, resume, quiet, overrides)
    trainer = state[4]
    if workers is None:
        model_bytes = sum(v.nbytes for _, v in tree_flatten(state[2].model.parameters()))
        workers = min(default_workers(trainer.backend, model_bytes), trainer.config.accum)
    if workers <= 1:
        return train_loop(state, log, None)
    if workers > trainer.config.accum:
        raise DFlashError(f"--workers {workers} but only {trainer.config.accum} micro-batch(es) per step: raise "
                          f"--batch-blocks to at least {workers * trainer.config.micro_blocks} or use fewer workers")
    out = Path(state[0].out)
    del state, trainer  # the ranks load their own copies
    LocalWorkers(workers, dict(args=dataclasses.asdict(args), resume=resume, steps=steps,
                               max_minutes=max_minutes)).run()
    return out
