"""What the kernel parity tests share: the dtypes they sweep and a switch that turns the kernels off in a block."""

from contextlib import contextmanager

import mlx.core as mx
import pytest

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@contextmanager
def kernels_enabled(on: bool):
    """Kernels on (the `metal_backend` fixture's backend) or off (DFLASH_MLX_NO_METAL) inside the block."""
    with pytest.MonkeyPatch.context() as mp:
        if not on:
            mp.setenv("DFLASH_MLX_NO_METAL", "1")
        yield
