"""A prompt-cache writer for tests/test_prefix_store_faults.py, killed with SIGKILL at random moments.

It imports the store once; then for every line `go ROUND DELAY_S` on stdin it forks a child that rewrites entries
into the folder without end, waits until the child has saved its first whole entry, sleeps DELAY_S (the writes
go on meanwhile), kills the child with SIGKILL, reaps it and prints `done SAVED STATUS` (SAVED: 1 once an entry
was saved; STATUS: the child's wait status). Forking keeps each of the many writers cheap to start: the parent
runs no MLX work, so the child begins from a clean state. The parent does the killing, so the test only reads
lines of one process.

Every entry's arrays are a function of its key (`entry(id, version)`), so the test can tell whether a loaded entry
is exact.

    python tests/prefix_store_writer.py FOLDER BUDGET_BYTES
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

LAYERS, HEADS, TOKENS, DIM = 2, 4, 256, 64  # 512 KiB per array, 2 MiB per entry: a write takes a few ms
IDS = 6  # entries rewritten in turn: every write replaces an older file


def key_of(entry_id: int, version: int):
    return [entry_id, version] + [(7 * i + entry_id) % 97 for i in range(TOKENS - 2)]


def arrays_of(entry_id: int, version: int):
    rng = np.random.default_rng(entry_id * 1_000_003 + version)
    return [(rng.standard_normal((1, HEADS, TOKENS, DIM), dtype=np.float32),
             rng.standard_normal((1, HEADS, TOKENS, DIM), dtype=np.float32)) for _ in range(LAYERS)]


def entry(entry_id: int, version: int):
    """(key, Snapshot) for an entry whose every value follows from (id, version)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.server.prefix_cache import Snapshot

    caches = []
    for keys, values in arrays_of(entry_id, version):
        cache = KVCache()
        cache.update_and_fetch(mx.array(keys), mx.array(values))
        caches.append(cache)
    key = key_of(entry_id, version)
    return key, Snapshot(caches, None, None, len(key), sum(c.nbytes for c in caches), True)


def _write_forever(folder: Path, budget: int, round_: int, signal_fd: int) -> None:
    import mlx.core as mx

    from dflash_mlx.server.prefix_store import PrefixStore

    mx.set_default_device(mx.cpu)  # a forked child keeps off the GPU (on macOS, Metal after fork is unsafe)

    store = PrefixStore(folder, "writer-pair", budget)
    n = 0
    while True:
        entry_id, version = n % IDS, round_ * 100_000 + n
        store.save(*entry(entry_id, version))
        if n == 0:
            os.write(signal_fd, b"s")  # one whole entry is on disk
            os.close(signal_fd)
        n += 1


def main() -> None:
    folder, budget = Path(sys.argv[1]), int(sys.argv[2])
    import dflash_mlx.server.prefix_store  # noqa: F401  (the slow imports, once, before any fork)

    print("ready", flush=True)
    for line in sys.stdin:
        _, round_, delay = line.split()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                _write_forever(folder, budget, int(round_), write_fd)
            finally:
                os._exit(1)
        os.close(write_fd)
        saved = os.read(read_fd, 1) == b"s"  # b"": the child died before it saved anything
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
        print(f"done {int(saved)} {status}", flush=True)


if __name__ == "__main__":
    main()
