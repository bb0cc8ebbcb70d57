"""Joining the mx.distributed group a launcher started, and making every rank behave as one program.

`mlx.launch` (ring, JACCL) and `mpirun` start one copy of the command per rank and tell each its rank through the
environment. `setup()` joins the group with a time limit (a host that cannot be reached is an error, not a hang),
gives every rank the same random seed (sampling decisions must agree, or the ranks stop meeting in the same
collectives), and leaves the terminal to rank 0.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Iterator, Optional

import mlx.core as mx

from ..decode.width import install_coordinator
from ..errors import DFlashError

# Seconds to wait for the other ranks to connect; a launcher starts them within a second or two of each other.
DEFAULT_TIMEOUT = 60.0
TIMEOUT_ENV = "DFLASH_MLX_CONNECT_TIMEOUT"

# Set by mlx.launch (MLX_RANK), mpirun (OMPI_COMM_WORLD_RANK) and other MPI launchers (PMI_RANK).
_RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

_group: Optional[mx.distributed.Group] = None
_seed: Optional[int] = None


def launched() -> bool:
    """Whether this process is one rank of a job of several, started by `mlx.launch` or an MPI launcher."""
    if not any(v in os.environ for v in _RANK_VARIABLES):
        return False
    # `mlx.launch` with a single host hands its one rank an empty hostfile (which MLX cannot parse).
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile):
        with open(hostfile) as f:
            return bool(f.read().strip())
    return os.environ.get("OMPI_COMM_WORLD_SIZE", "2") != "1"


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise DFlashError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise DFlashError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def init_group(backend: str = "any", timeout: Optional[float] = None) -> mx.distributed.Group:
    """Join the group this process was launched into; fail with one line if the others cannot be reached in time.

    MLX's ring backend waits for its neighbours in a blocking accept that holds the interpreter, so the limit is a
    SIGALRM (it interrupts the accept). A connecting rank cannot be interrupted: MLX gives up by itself after about
    30 s, so the error names the time really waited.
    """
    if not mx.distributed.is_available():
        raise DFlashError("this MLX build has no distributed backend; install mlx with distributed support")
    timeout = _timeout() if timeout is None else timeout
    fired = []
    use_alarm = threading.current_thread() is threading.main_thread()
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(True))
        signal.setitimer(signal.ITIMER_REAL, timeout)
    started = time.monotonic()
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        hosts = os.environ.get("MLX_HOSTFILE", "the hostfile")
        if fired:
            waited = time.monotonic() - started
            shown = f"{timeout:g}" if waited < timeout + 1 else f"{waited:.0f}"
            raise DFlashError(f"rank {_env_rank()} could not reach the other ranks within {shown} s (hosts in "
                              f"{hosts}); check that every host is up and reachable, or raise {TIMEOUT_ENV}") from e
        raise DFlashError(f"rank {_env_rank()} could not join the distributed group ({e}); check the hosts in "
                          f"{hosts} and that every rank was started") from e
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return group


def _env_rank() -> str:
    return next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "?")


def share_seed(group: mx.distributed.Group) -> int:
    """Seed MLX's global generator with one value drawn on rank 0, so every rank draws the same numbers."""
    mine = secrets.randbelow(2**31 - 1) if group.rank() == 0 else 0
    seed = int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group, stream=mx.cpu).item())
    mx.random.seed(seed)
    return seed


def quiet_unless_rank0(group: mx.distributed.Group) -> None:
    """Ranks other than 0 print nothing (rank 0 owns the output and the one-line errors); their crashes still
    reach stderr, tagged with the rank."""
    if group.rank() == 0:
        return
    rank = group.rank()
    stderr = sys.__stderr__
    devnull = open(os.devnull, "w")
    sys.stdout = devnull
    sys.stderr = devnull
    logging.getLogger("dflash_mlx").disabled = True

    def report(kind, value, tb):
        stderr.write(f"[rank {rank}] " + "".join(traceback.format_exception(kind, value, tb)))

    sys.excepthook = report


def setup(backend: str = "any", timeout: Optional[float] = None, quiet: bool = True) -> mx.distributed.Group:
    """Once per process: join the group, share the seed, leave the output to rank 0. Returns the group."""
    global _group, _seed
    if _group is None:
        group = init_group(backend, timeout)
        if group.size() > 1:
            _seed = share_seed(group)
            install_coordinator(agree_on_width)  # every adaptive width policy built from now on paces alike
            if quiet:
                quiet_unless_rank0(group)
        _group = group
    return _group


def shared_seed() -> Optional[int]:
    """The seed every rank drew alike in `setup` (None outside a group of several ranks)."""
    return _seed


class SharedClock:
    """A width policy fed rank 0's cycle times on every rank, so that every rank chooses the same widths.

    An adaptive width policy learns from measured seconds per cycle; each rank measures its own, and ranks that
    chose different widths would verify blocks of different sizes and never meet in the same collectives again.
    Costs one 4-byte all-sum per cycle.
    """

    def __init__(self, policy, group: mx.distributed.Group):
        self.policy, self.group = policy, group

    def choose(self) -> int:
        return self.policy.choose()

    def record(self, width: int, accepted: int, seconds: float) -> None:
        from mlx_lm.generate import generation_stream

        mine = seconds if self.group.rank() == 0 else 0.0
        # On the engine's stream: queued behind whatever collectives it still has in flight, on every rank alike.
        shared = mx.distributed.all_sum(mx.array(mine, dtype=mx.float32), group=self.group, stream=generation_stream)
        self.policy.record(width, accepted, float(shared.item()))


def agree_on_width(policy):
    """`policy` as every rank must run it: wrapped in `SharedClock` inside a group of several ranks."""
    return SharedClock(policy, _group) if _group is not None and _group.size() > 1 else policy


def barrier(group: mx.distributed.Group) -> None:
    """Wait until every rank reaches this point."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


@contextmanager
def rank0_first(group: mx.distributed.Group) -> Iterator[None]:
    """Rank 0 runs the block before the others: downloads and conversions into a shared cache happen once."""
    if group.rank() != 0:
        barrier(group)
    try:
        yield
    finally:
        if group.rank() == 0:
            barrier(group)
