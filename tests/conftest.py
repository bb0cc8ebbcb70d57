"""Shared test setup: make `tiny` importable however pytest is invoked, and keep hypothesis offline and quick."""

# dflash_mlx first: on Linux it loads OpenBLAS for MLX, which only works before anything imports mlx.
import dflash_mlx  # noqa: F401  isort: skip

import os
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
