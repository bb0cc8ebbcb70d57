"""Giving memory back when the server goes idle, so a server that runs for days holds its resident memory flat.

Two things keep freed memory resident after a request: MLX's buffer cache (freed arrays are kept for reuse, up to
the memory limit by default) and, on Linux, glibc's malloc, which keeps freed heap pages (and, after a large
free, raises its mmap threshold so later big buffers come from the heap too). Measured with
benchmarks/server_soak.py on the tiny pair: without a release RSS rose ~12% over 500 requests after warm-up;
the buffer cache alone accounts for up to 32 MiB of it, malloc for the rest.

`MemoryKeeper` watches the worker: once no request has been running or waiting for `idle_s` since one finished,
it clears MLX's buffer cache and trims malloc's heap, once per idle spell. Nothing is released while a request
runs, so generation speed is untouched; the next request after an idle spell allocates its buffers anew.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
from typing import Callable, Optional

import mlx.core as mx

logger = logging.getLogger("dflash_mlx.server")


def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None  # macOS's allocator returns freed pages by itself
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and other libcs have no malloc_trim
        return None


_TRIM = _malloc_trim()


def release() -> None:
    """Free MLX's cached buffers and hand malloc's free pages back to the system."""
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)


class MemoryKeeper:
    """Calls `release` once per idle spell of the worker (see the module docstring)."""

    def __init__(self, worker, activity: Callable[[], int], idle_s: float = 0.5):
        self.worker = worker
        self.activity = activity  # a count that grows with every request (one may start and end between checks)
        self.idle_s = idle_s
        self.releases = 0
        self._seen = -1  # the activity count at the last release
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def caught_up(self) -> bool:
        """Whether memory was released after the last request (a soak measures then)."""
        return self._seen == self.activity()

    def _idle(self) -> bool:
        return not self.worker.running and not self.worker.waiting

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.idle_s)
            seen = self.activity()
            if seen == self._seen or not self._idle():
                continue
            await asyncio.sleep(self.idle_s)  # idle for a whole period, not between two requests of a client
            if self._idle() and self.activity() == seen:
                try:
                    # On the worker thread: MLX is driven from that one thread, and a buffer-cache release
                    # beside a pass running on it corrupted that pass's buffers.
                    await asyncio.wrap_future(self.worker.call_soon(release))
                except Exception:  # never take the server down over housekeeping
                    logger.exception("releasing memory failed")
                self.releases += 1
                self._seen = seen
