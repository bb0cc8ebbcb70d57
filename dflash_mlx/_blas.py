"""Make MLX's Linux CPU backend use OpenBLAS instead of the reference BLAS its wheel bundles.

The `mlx[cpu]` wheel links a reference BLAS (fp32 GEMM ≈ 2.5 GFLOP/s), so a k-token verify costs about k
one-token steps and speculative decoding cannot win on CPU. Loading Debian's `libopenblas0-pthread` with
RTLD_GLOBAL before `mlx.core` puts its `sgemm_` first in the symbol search order, and MLX's GEMMs run through it.
This only works before mlx is imported: `dflash_mlx/__init__.py` calls `load_openblas()` first thing.
`DFLASH_MLX_NO_BLAS=1` turns it off. bf16, fp16 and quantized matmuls do not use BLAS on CPU.
Measured effect: `python benchmarks/cpu_blas.py` (README, "CPU performance").
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from typing import Optional

_SUBDIR = "openblas-pthread/libblas.so.3"

# What happened at import: the library path loaded, or why none was.
status: str = "not attempted"
loaded: Optional[str] = None


def find_openblas() -> Optional[str]:
    """Debian/Ubuntu's pthread OpenBLAS (package libopenblas0-pthread), for this machine's multiarch triple."""
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    candidates = [f"/usr/lib/{arch}-linux-gnu/{_SUBDIR}", f"/usr/lib/{_SUBDIR}", f"/usr/lib64/{_SUBDIR}"]
    candidates += sorted(glob.glob(f"/usr/lib/*-linux-gnu/{_SUBDIR}"))
    return next((path for path in candidates if os.path.exists(path)), None)


def load_openblas() -> Optional[str]:
    """Load OpenBLAS globally if we are on Linux, mlx is not imported yet, and it is not turned off."""
    global status, loaded
    if status != "not attempted":  # once per process
        return loaded
    if not sys.platform.startswith("linux"):
        status = "not Linux (MLX uses Accelerate or the GPU)"
    elif os.environ.get("DFLASH_MLX_NO_BLAS", "").strip() not in ("", "0"):
        status = "off (DFLASH_MLX_NO_BLAS is set)"
    elif "mlx.core" in sys.modules:
        # Too late: mlx already resolved its BLAS symbols. Import dflash_mlx before mlx to get the fast path.
        status = "skipped: mlx.core was imported before dflash_mlx"
    elif (path := find_openblas()) is None:
        status = "not found (apt-get install libopenblas0-pthread for fast fp32 matmuls)"
    else:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            status = f"could not load {path}: {e}"
        else:
            loaded, status = path, f"loaded {path}"
    if os.environ.get("DFLASH_MLX_DEBUG"):
        print(f"dflash-mlx: OpenBLAS {status}", file=sys.stderr)
    return loaded
