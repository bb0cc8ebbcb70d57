"""Starting several ranks on this machine (ring backend on 127.0.0.1), for tests and benchmarks.

It does what `mlx.launch --hosts 127.0.0.1 -n N` does for the ring backend (a hostfile with one address per rank,
`MLX_RANK` and `MLX_HOSTFILE` in each rank's environment), with free ports picked by the OS and a hard time limit:
a rank that waits for a peer that went away is killed, never left hanging. When one rank fails, the others get a
few seconds to finish and are then stopped, as `mlx.launch` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

# Seconds the other ranks get to exit on their own after one rank failed.
GRACE = 5.0


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed at the time limit
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def free_ports(n: int) -> List[int]:
    """n TCP ports on 127.0.0.1 that are free right now."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_hostfile(path: Path, ranks: int) -> Path:
    """A ring hostfile with `ranks` entries on 127.0.0.1: `[["127.0.0.1:PORT"], ...]`."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    return path


def run_local(argv: Sequence[str], ranks: int = 2, timeout: float = 60.0, env: Optional[Dict[str, str]] = None,
              hostfile: Optional[Path] = None, cwd: Optional[str] = None) -> List[RankResult]:
    """Run `argv` once per rank, all joined in one ring on 127.0.0.1; return each rank's exit code and output.

    `hostfile` overrides the generated one (e.g. to name a rank that is never started).
    """
    with LocalRanks(argv, ranks, env, cwd, hostfile) as started:
        return started.wait(timeout)


class LocalRanks:
    """Ranks started now and collected later (`wait`), for a test that talks to them meanwhile (e.g. over HTTP).

    `procs[r]` is rank r's process; leaving the `with` block kills any rank still running. Ranks in `inherit` write
    to this process's stdout and stderr instead of files (their captured output reads empty).
    """

    def __init__(self, argv: Sequence[str], ranks: int = 2, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, hostfile: Optional[Path] = None, inherit: Sequence[int] = ()):
        self._tmp = tempfile.TemporaryDirectory(prefix="dflash-ranks-")
        tmp_path = Path(self._tmp.name)
        hostfile = hostfile or write_hostfile(tmp_path / "hosts.json", ranks)
        self.procs: List[subprocess.Popen] = []
        self._outs = []
        for rank in range(ranks):
            out, err = open(tmp_path / f"{rank}.out", "w+"), open(tmp_path / f"{rank}.err", "w+")
            rank_env = dict(os.environ, **(env or {}), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            stdio = dict(stdout=None, stderr=None) if rank in inherit else dict(stdout=out, stderr=err)
            self.procs.append(subprocess.Popen(list(argv), env=rank_env, cwd=cwd, start_new_session=True, **stdio))
            self._outs.append((out, err))

    def wait(self, timeout: float) -> List[RankResult]:
        """Every rank's result; ranks still running after `timeout` seconds (or GRACE after a failure) are killed."""
        killed = _wait(self.procs, time.monotonic() + timeout)
        results = []
        for rank, (p, (out, err)) in enumerate(zip(self.procs, self._outs)):
            out.seek(0)
            err.seek(0)
            results.append(RankResult(rank, None if rank in killed else p.returncode, out.read(), err.read()))
        return results

    def __enter__(self) -> "LocalRanks":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for out, err in self._outs:
            out.close()
            err.close()
        self._tmp.cleanup()


def _wait(procs: List[subprocess.Popen], deadline: float) -> Set[int]:
    """Wait for every rank; kill those still running at the deadline or GRACE after a failure. Returns them."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE):
            killed = {i for i, p in enumerate(procs) if p.poll() is None}
            for i in killed:
                os.killpg(procs[i].pid, signal.SIGKILL)  # its own session: the rank and anything it started
                procs[i].wait()
            return killed
        time.sleep(0.05)
    return set()
