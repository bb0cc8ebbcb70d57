"""One rank of tests/test_train_parallel.py: a tiny trainer joined to the group, a few data-parallel steps, and one
JSON line with a digest of its weights and optimizer state, the step's statistics and the slot counters.

    python tests/train_parallel_worker.py CACHE_DIR STEPS
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from test_train import _trainer  # noqa: E402

from dflash_mlx.distributed.group import setup  # noqa: E402
from dflash_mlx.train.features import FeatureCache  # noqa: E402
from dflash_mlx.train.parallel import DataParallel  # noqa: E402


def digest(tree) -> str:
    h = hashlib.sha256()
    for name, value in sorted(tree_flatten(tree), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(np.array(value).tobytes())
    return h.hexdigest()


def main() -> None:
    cache_dir, steps = sys.argv[1], int(sys.argv[2])
    group = setup(quiet=False)
    # Each rank starts from different weights: joining must give every rank rank 0's.
    trainer = _trainer(FeatureCache.open(Path(cache_dir), {"t": 1}), seed=1 + group.rank(), batch_blocks=48)
    trainer.join(DataParallel(group))
    stats = [trainer.train_step() for _ in range(steps)]
    mx.eval(trainer.drafter.parameters())
    out = dict(rank=group.rank(), params=digest(trainer.drafter.parameters()), opt=digest(trainer.optimizer.state),
               stats=stats, predicted=trainer.predicted, context=trainer.context_tokens)
    if group.rank() == 0:
        mx.save_safetensors(str(Path(cache_dir).parent / "rank0.safetensors"),
                            dict(tree_flatten(trainer.drafter.parameters())))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
