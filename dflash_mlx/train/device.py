"""Where training runs: the device MLX picked (Apple GPU, NVIDIA GPU through MLX's CUDA backend, or the CPU), and
whether the feature cache fits in that device's memory.

MLX chooses the device itself: `mx.default_device()` is the GPU whenever the installed MLX has a GPU backend (Metal
on Apple silicon; `pip install "mlx[cuda13]"` on Linux with an NVIDIA GPU), else the CPU. The trainer keeps the
whole feature cache on a GPU when it fits under a share of the device's memory (then a batch is a gather on the
device, with no host copy); on the CPU, or when it does not fit, rows stay memory-mapped on the host and are read
per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import mlx.core as mx

# Leave room for the drafter, its optimizer state, activations and the frozen target's embedding and head.
FEATURE_SHARE = 0.4


@dataclass(frozen=True)
class DeviceChoice:
    device: mx.Device
    backend: str  # "metal", "cuda" or "cpu"
    name: str  # e.g. "Apple M3 Max", "NVIDIA H100 80GB HBM3", "AMD EPYC"
    memory: Optional[int]  # bytes the device may use, None when unknown (the CPU: host memory)

    def describe(self) -> str:
        mem = f", {self.memory / 2 ** 30:.0f} GiB" if self.memory else ""
        return f"{self.backend} ({self.name}{mem})"


def _available(module: str) -> bool:
    sub = getattr(mx, module, None)
    try:
        return bool(sub is not None and sub.is_available())
    except Exception:  # a backend module present but unusable (no driver) counts as absent
        return False


def pick_device(default: Optional[mx.Device] = None, info: Optional[Callable[[mx.Device], Mapping]] = None,
                metal: Optional[bool] = None, cuda: Optional[bool] = None) -> DeviceChoice:
    """The device training runs on (MLX's default) and what is known about it.

    The arguments stand in for MLX's own answers (tests pass fakes): the default device, `mx.device_info`, and
    whether the Metal and CUDA backends are available.
    """
    device = default if default is not None else mx.default_device()
    info = info or (lambda d: mx.device_info(d))
    try:
        facts = dict(info(device))
    except Exception:
        facts = {}
    name = str(facts.get("device_name") or facts.get("architecture") or "unknown")
    if device.type == mx.gpu:
        metal = _available("metal") if metal is None else metal
        cuda = _available("cuda") if cuda is None else cuda
        backend = "metal" if metal else "cuda" if cuda else "gpu"
        # Metal reports a recommended working set (what the GPU may wire); CUDA its free and total memory.
        memory = (facts.get("max_recommended_working_set_size") or facts.get("free_memory")
                  or facts.get("memory_size") or facts.get("total_memory"))
        return DeviceChoice(device, backend, name, int(memory) if memory else None)
    return DeviceChoice(device, "cpu", name, None)


def features_on_device(nbytes: int, choice: DeviceChoice, share: float = FEATURE_SHARE) -> bool:
    """Keep the feature cache ([rows, seq, taps*hidden] fp16, `nbytes`) resident on the device?

    Only on a GPU whose memory is known and only when the cache takes at most `share` of it; the CPU reads rows
    from the memory-mapped file (the OS page cache keeps hot rows in RAM without a second copy).
    """
    return choice.backend != "cpu" and choice.memory is not None and nbytes <= share * choice.memory


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory MLX frees on the CPU backend instead of handing it back to the kernel.

    MLX's CPU allocator frees every activation after use; glibc returns large blocks (>= 128 KiB by default) to
    the kernel, so each training step page-faults its activations in anew (zeroed by the kernel): ~17% of a step's
    time, all in the kernel. Raising the mmap and trim thresholds keeps those pages in the process for reuse.
    Peak memory is unchanged. Returns whether the settings were applied (glibc on Linux only).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1  # blocks up to 1 GiB come from (and return to) the heap
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 and ok)  # keep up to 1 GiB free at its top
