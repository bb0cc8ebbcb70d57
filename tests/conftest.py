"""Shared test setup: make `tiny` importable however pytest is invoked, and keep hypothesis offline and quick."""

import os

# Tests run on MLX's bundled BLAS, never OpenBLAS: OpenBLAS sums a row differently depending on how many rows a
# matmul has, so a cache rolled back from a 5-row verify would differ in the last bit from one built by a 3-row
# pass, and the bit-exact rollback checks (tests/cache_compare.py) could not hold. tests/test_blas.py checks the
# OpenBLAS loader in subprocesses of its own.
os.environ.setdefault("DFLASH_MLX_NO_BLAS", "1")

import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for path in (_HERE, _ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

try:
    from hypothesis import HealthCheck, settings

    # No example database on disk; no wall-clock deadline (the first example pays for mlx graph warm-up).
    settings.register_profile(
        "dflash", database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("dflash")
except ImportError:  # hypothesis is a dev extra; the property tests skip without it
    pass


import pytest


@pytest.fixture
def metal_backend():
    """Run dflash_mlx.metal kernels on real Metal where present, otherwise on the MSL emulator (tests/msl)."""
    import mlx.core as mx

    if mx.metal.is_available():
        yield "metal"
        return
    from msl import emulator

    if not emulator.supported():
        pytest.skip("neither Metal nor the MSL emulator (Linux with g++: apt-get install g++)")
    with emulator.installed():
        yield "emulator"
