"""OpenBLAS for MLX's Linux CPU backend: loaded by `import dflash_mlx` before mlx, off with DFLASH_MLX_NO_BLAS=1,
and left alone when mlx was imported first. The loading case runs in a fresh interpreter (the BLAS binds when mlx
loads); the others call the loader again in this one."""

import os
import subprocess
import sys

import pytest

from dflash_mlx._blas import find_openblas

needs_openblas = pytest.mark.skipif(find_openblas() is None, reason="libopenblas0-pthread is not installed")


def _status(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != "DFLASH_MLX_NO_BLAS"}
    full.update(env)
    done = subprocess.run([sys.executable, "-c", code + "; import dflash_mlx._blas as b; print(b.status)"],
                          env=full, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@needs_openblas
def test_loaded_before_mlx():
    status = _status("import dflash_mlx; import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))")
    assert status == f"loaded {find_openblas()}"


def test_switched_off_by_environment(monkeypatch):
    from dflash_mlx import _blas

    monkeypatch.setattr(_blas, "status", "not attempted")
    monkeypatch.setattr(_blas, "loaded", None)
    monkeypatch.setenv("DFLASH_MLX_NO_BLAS", "1")
    assert _blas.load_openblas() is None and _blas.status.startswith("off")


def test_too_late_after_mlx(monkeypatch):
    import mlx.core  # noqa: F401  (in this process mlx is loaded already)

    from dflash_mlx import _blas

    monkeypatch.setattr(_blas, "status", "not attempted")
    monkeypatch.setattr(_blas, "loaded", None)
    monkeypatch.delenv("DFLASH_MLX_NO_BLAS", raising=False)
    assert _blas.load_openblas() is None and _blas.status.startswith("skipped: mlx.core was imported")
