"""A prompt-cache writer for tests/test_prefix_store_faults.py to kill with SIGKILL at random moments.

It imports the store once, then for every line `go ROUND` on stdin forks a child that rewrites entries into the
folder without end (printing `saved ID VERSION` after each) and prints `child PID`; it waits for that child to
die (the test kills it), prints `reaped`, and reads the next line. Forking keeps each of the many writers cheap
to start: the parent runs no MLX work, so the child begins from a clean state.

Every entry's arrays are a function of its key (`entry(id, version)`), so the test can tell whether a loaded entry
is exact.

    python tests/prefix_store_writer.py FOLDER BUDGET_BYTES
"""

from __future__ import annotations

import os
import sys
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


def _write_forever(folder: Path, budget: int, round_: int) -> None:
    from dflash_mlx.server.prefix_store import PrefixStore

    store = PrefixStore(folder, "writer-pair", budget)
    n = 0
    while True:
        entry_id, version = n % IDS, round_ * 100_000 + n
        store.save(*entry(entry_id, version))
        print(f"saved {entry_id} {version}", flush=True)
        n += 1


def main() -> None:
    folder, budget = Path(sys.argv[1]), int(sys.argv[2])
    import dflash_mlx.server.prefix_store  # noqa: F401  (the slow imports, once, before any fork)

    print("ready", flush=True)
    for line in sys.stdin:
        round_ = int(line.split()[1])
        pid = os.fork()
        if pid == 0:
            try:
                _write_forever(folder, budget, round_)
            finally:
                os._exit(1)
        print(f"child {pid}", flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main()
