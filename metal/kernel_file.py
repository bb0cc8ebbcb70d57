"""Read a `*.metal` kernel file of this package (its shared helpers and named kernel bodies), and say whether
kernels run for the current stream.

`mx.fast.metal_kernel` takes a kernel *body* (MLX writes the signature) plus a header. One file holds one
kernel, which may need several passes: the text before the first `// ---- kernel: NAME` line is the file's
header (helpers and constants, appended to `dflash_common.h`), and each marker starts one body.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict

import mlx.core as mx

from . import available, read_source

_MARKER = re.compile(r"^// ---- kernel: (\w+)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class KernelFile:
    header: str  # dflash_common.h, then the file's own helpers
    bodies: Dict[str, str]  # kernel name -> body


def load_kernel_file(name: str) -> KernelFile:
    text = read_source(name)
    parts = _MARKER.split(text)
    if len(parts) < 3:
        raise ValueError(f"{name} has no '// ---- kernel: NAME' section")
    bodies = {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}
    return KernelFile(header=read_source("dflash_common.h") + "\n" + parts[0], bodies=bodies)


def kernels_on() -> bool:
    """Whether dispatchers should run kernels now: `available()`, and on a Mac a GPU default stream (a Metal
    kernel cannot run on the CPU stream; an installed test backend runs on any)."""
    return available() and (not mx.metal.is_available() or mx.default_device() == mx.gpu)
