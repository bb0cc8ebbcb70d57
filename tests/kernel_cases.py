"""What the kernel parity tests share: the dtypes they sweep, a switch that turns the kernels off in a block, and
the `metal_backend` fixture they run on (import it into the test module, where it overrides conftest's)."""

from contextlib import contextmanager

import mlx.core as mx
import pytest

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

# Off a Mac every kernel test runs twice on the emulator: multiply-adds never fused, and fused wherever g++ can
# (across statements too). A result that must be bit-exact may not depend on what the compiler fuses.
BACKENDS = ["metal"] if mx.metal.is_available() else ["contract-off", "contract-fast"]


@pytest.fixture(params=BACKENDS)
def metal_backend(request):
    """Run dflash_mlx.metal kernels on real Metal where present ("metal"), otherwise on the MSL emulator
    ("emulator"), once per multiply-add contraction (`msl.emulator.current_contraction()` says which)."""
    if request.param == "metal":
        yield "metal"
        return
    from msl import emulator

    if not emulator.supported():
        pytest.skip("neither Metal nor the MSL emulator (Linux with g++: apt-get install g++)")
    with emulator.installed(contract=request.param.removeprefix("contract-")):
        yield "emulator"


@contextmanager
def kernels_enabled(on: bool):
    """Kernels on (the `metal_backend` fixture's backend) or off (DFLASH_MLX_NO_METAL) inside the block."""
    with pytest.MonkeyPatch.context() as mp:
        if not on:
            mp.setenv("DFLASH_MLX_NO_METAL", "1")
        yield
