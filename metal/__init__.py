"""Metal kernel sources for dflash-mlx, and the switch that decides whether they run.

Every kernel follows one pattern, as mlx-lm's own kernels do:

1. Metal source: a `*.metal` body in this folder, compiled with `mx.fast.metal_kernel` using
   `dflash_common.h` as its header. Built once (a module-level factory), never inside the decode loop.
2. Reference: a pure-MLX function with the same signature and the same result; it runs everywhere (Linux CPU
   included) and is the definition the kernel must match.
3. Dispatcher: calls the kernel when `available()`, otherwise the reference.
4. Parity test: runs kernel and reference on the same inputs and compares them; skipped where Metal is absent.

Setting `DFLASH_MLX_NO_METAL=1` turns every kernel off, so the references run even on a Mac.
The sources ship as package data (`dflash_mlx.metal`), so `read_source` works from a wheel and from an
editable install alike.
"""

from __future__ import annotations

import os
from importlib import resources

NO_METAL_ENV = "DFLASH_MLX_NO_METAL"


def read_source(name: str) -> str:
    """Text of a kernel source or header in this package, e.g. `read_source("dflash_common.h")`."""
    source = resources.files(__name__).joinpath(name)
    if not source.is_file():
        raise FileNotFoundError(f"no Metal source {name!r} in {__name__}; is the package installed with its data?")
    return source.read_text(encoding="utf-8")


def available() -> bool:
    """True where Metal kernels may run: a Metal device is present and DFLASH_MLX_NO_METAL is not set."""
    if os.environ.get(NO_METAL_ENV, "") not in ("", "0"):
        return False
    import mlx.core as mx

    return bool(mx.metal.is_available())
