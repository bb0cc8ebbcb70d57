"""Data-parallel training: several ranks share every optimizer step's micro-batches and add up their gradients.

Every rank holds the same weights and optimizer state (rank 0's, sent to all when training starts), builds
micro-batch i of step t from the same seed as a single process would, computes the micro-batches with
i % ranks == rank, and joins the others in one all-sum of the gradients, the loss normalizer and the statistics.
Every rank then applies the same AdamW update to the same summed gradient, so the weights stay identical on every
rank (an addition's result does not depend on its operands' order) without ever being sent again. Rank 0 alone
evaluates, checkpoints and writes the drafter; the others wait for it in the next step's all-sum.

Where the ranks come from:
  - `dflash-mlx train --workers N` prepares the data and feature cache, then starts N processes on this machine
    (MLX's ring backend on 127.0.0.1, as `mlx.launch --hosts 127.0.0.1 -n N` would) and waits for them; rank 0
    draws on this terminal. On a CPU one process keeps about one core busy (MLX's CPU kernels and the bundled
    OpenBLAS run on one thread), so N processes train about N times as many slots per second on N cores.
    `--workers` defaults to one per core on the CPU when memory allows.
  - `mlx.launch ... -- dflash-mlx train ...` on several machines: one rank per machine; rank 0 builds the feature
    cache first, the others then open it (a shared directory) or build their own copy (the same data on every
    machine gives the same cache).

The sum over ranks adds the same per-micro-batch gradients as a single process, grouped differently, so a run on
N ranks matches a one-process run to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import DFlashError

# Exit code of a rank whose peer went away (the cause is another rank's failure).
LOST = 3

# Bytes one rank needs beyond the target's weights (activations of a 128-anchor micro-batch, drafter, optimizer).
RANK_OVERHEAD = 3 * 2 ** 30


class DataParallel:
    """The collectives of data-parallel training over an `mx.distributed` group, on the CPU stream (where the ring
    and MPI backends run; on Apple silicon the memory is shared anyway; NCCL's GPU-only collectives are untested)."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def share(self, count: int) -> range:
        """This rank's micro-batches of a step that has `count`."""
        return range(self.rank, count, self.size)

    def sum(self, tree):
        """Element-wise sum over the ranks of a tree of arrays."""
        return tree_map(lambda x: mx.distributed.all_sum(x, group=self.group, stream=mx.cpu), tree)

    def broadcast(self, tree):
        """Rank 0's values of a tree of arrays, on every rank."""
        return tree_map(lambda x: mx.distributed.all_sum(x if self.rank == 0 else mx.zeros_like(x), group=self.group,
                                                         stream=mx.cpu), tree)

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer to a yes/no question (e.g. "stop now?"), on every rank."""
        mine = mx.array(1 if (flag and self.rank == 0) else 0, dtype=mx.int32)
        return bool(mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu).item())


def sync_state(trainer, parallel: DataParallel) -> None:
    """Give every rank rank 0's trainable weights and optimizer state."""
    params = parallel.broadcast(trainer.drafter.trainable_parameters())
    state = parallel.broadcast(dict(tree_flatten(trainer.optimizer.state)))
    mx.eval(params, state)
    trainer.drafter.update(params)
    trainer.optimizer.state = tree_unflatten(list(state.items()))


def default_workers(backend: str, model_bytes: int, cores: Optional[int] = None,
                    memory: Optional[int] = None) -> int:
    """Processes to train with on this machine: one per core on the CPU, as many as half the free memory holds
    (each loads the target); 1 on a GPU (one process already fills it)."""
    if backend != "cpu":
        return 1
    cores = cores if cores is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    memory = memory if memory is not None else available_memory()
    fit = cores if memory is None else int(0.5 * memory // max(model_bytes + RANK_OVERHEAD, 1))
    return max(1, min(cores, fit))


def available_memory() -> Optional[int]:
    """Bytes of memory free for new processes (Linux: MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class LocalWorkers:
    """Ranks 0..N-1 of a data-parallel run on this machine, each `python -m dflash_mlx.train.worker SPEC`, joined in
    one ring on 127.0.0.1. Rank 0 writes to this process's terminal (progress, log); the calling process only waits.
    A process can join one MLX ring in its lifetime, so the caller never joins: it can start runs again and again.
    """

    def __init__(self, count: int, spec: Dict):
        self.count = count
        self.spec = spec

    def run(self) -> None:
        """Start the ranks and wait for all of them; a rank's failure becomes one DFlashError line."""
        from ..distributed.local import LocalRanks

        with tempfile.TemporaryDirectory(prefix="dflash-train-") as errors:
            spec = dict(self.spec, errors=errors)
            argv = [sys.executable, "-m", "dflash_mlx.train.worker", json.dumps(spec)]
            env = {"OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # ranks split the cores: one thread each
            with LocalRanks(argv, self.count, env=env, inherit=(0,)) as ranks:
                results = ranks.wait(float("inf"))
            failed = [r for r in results if r.returncode != 0]
            if not failed:
                return
            # The cause first: ranks that only lost their peer (LOST) or were stopped after a failure follow it.
            causes = [r for r in failed if r.returncode not in (LOST, None)] or failed
            r = causes[0]
            file = Path(errors) / f"rank-{r.rank}.txt"
            if file.is_file():
                raise DFlashError(file.read_text().strip())
            if r.returncode is not None and r.returncode < 0:
                signal = -r.returncode
                raise DFlashError(f"training rank {r.rank} was stopped by signal {signal}"
                                  + (" (out of memory? try fewer --workers)" if signal == 9 else ""))
            tail = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[ring]")]
            raise DFlashError(f"training rank {r.rank} failed (exit code {r.returncode})"
                              + (f": {tail[-1]}" if tail else ""))


def report_error(spec: Dict, rank: int, message: str) -> None:
    """Leave a rank's one-line error for `LocalWorkers.run` to show."""
    if spec.get("errors"):
        (Path(spec["errors"]) / f"rank-{rank}.txt").write_text(message + "\n")
