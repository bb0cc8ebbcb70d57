"""One extra rank of `dflash-mlx train --workers N`, started by `parallel.LocalWorkers`:

    python -m dflash_mlx.train.worker SPEC_JSON

SPEC_JSON holds the run's options (`TrainArgs` fields), how `run` was called (`resume`, `steps`, `max_minutes`) and
a directory for a one-line error (`errors`); `MLX_RANK` and `MLX_HOSTFILE` in the environment place this process
in the group. Every rank trains its share of every step in lockstep; rank 0 prints, evaluates and writes.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv=None) -> int:
    from ..distributed.group import launched
    from ..errors import DFlashError
    from .args import TrainArgs
    from .launch import run
    from .parallel import LOST, report_error

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not launched():
        print("dflash-mlx: this is one rank of `dflash-mlx train --workers N`, which starts it; run that instead",
              file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    try:
        run(TrainArgs(**spec["args"]), resume=spec["resume"], steps=spec["steps"], max_minutes=spec["max_minutes"],
            announce=False)
    except DFlashError as e:
        report_error(spec, int(os.environ["MLX_RANK"]), str(e))  # the starting process prints it, once
        return 2
    except RuntimeError as e:
        if "[ring]" not in str(e):
            raise
        return LOST  # another rank stopped; its failure is the one to report
    return 0


if __name__ == "__main__":
    sys.exit(main())
