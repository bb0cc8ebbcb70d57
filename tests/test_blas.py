"""The fast BLAS for MLX's Linux CPU backend: loaded by `import dflash_mlx` before mlx, off with DFLASH_MLX_NO_BLAS=1,
left alone when mlx was imported first, and brought by pip alone (a fresh venv with only the wheels the package
depends on). Loading cases run in fresh interpreters (the BLAS binds when mlx loads); the others call the loader
again in this one."""

import ctypes.util
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx import _blas
from dflash_mlx._blas import find_debian_openblas, find_pip_openblas

ROOT = Path(__file__).resolve().parents[1]
needs_debian = pytest.mark.skipif(find_debian_openblas() is None, reason="libopenblas0-pthread is not installed")
needs_pip_blas = pytest.mark.skipif(find_pip_openblas() is None, reason="the cvxopt wheel is not installed")
GEMM = "import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"



# Loads _blas.py on its own (stdlib only, no package import), then mlx, and times a fp32 GEMM.
_PROBE = r"""
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("blas", sys.argv[1])
blas = sys.modules["blas"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)
blas.load_openblas()
import mlx.core as mx
a, b = mx.random.normal((512, 512)), mx.random.normal((512, 512))
mx.eval(a @ b)
times = []
for _ in range(3):
    t = time.perf_counter()
    mx.eval(a @ b)
    times.append(time.perf_counter() - t)
print(json.dumps({"status": blas.status, "source": blas.source, "seconds": min(times)}))
"""


def _clean_env(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("DFLASH_MLX_NO_BLAS", "DFLASH_MLX_BLAS", "PYTHONPATH")}
    full.update(env)
    return full


def _probe(tmp_path: Path, python: str = sys.executable, **env) -> dict:
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    done = subprocess.run([python, str(probe), str(ROOT / "dflash_mlx" / "_blas.py")], env=_clean_env(**env),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_loads_the_first_found_before_mlx():
    code = f"import dflash_mlx; {GEMM}; import dflash_mlx._blas as b; print(b.status)"
    done = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    first = find_pip_openblas() or find_debian_openblas()
    expected = f"loaded {first.name} ({first.libraries[-1]})" if first else _blas._choose()[1]
    assert done.stdout.strip().splitlines()[-1] == expected


@needs_debian
def test_debian_openblas(tmp_path):
    got = _probe(tmp_path, DFLASH_MLX_BLAS="debian")
    assert got["status"] == f"loaded Debian OpenBLAS ({find_debian_openblas().libraries[-1]})"


@needs_pip_blas
def test_pip_openblas(tmp_path):
    got = _probe(tmp_path, DFLASH_MLX_BLAS="pip")
    assert got["status"] == f"loaded OpenBLAS from the cvxopt wheel ({find_pip_openblas().libraries[-1]})"


def test_unloadable_library_is_reported(tmp_path):
    bogus = tmp_path / "libnot-a-blas.so"
    bogus.write_text("not an ELF file")
    got = _probe(tmp_path, DFLASH_MLX_BLAS=str(bogus))
    assert got["status"].startswith(f"could not load {bogus}") and got["source"] is None


def test_library_without_cblas_is_refused(tmp_path):
    # A real shared library that is no BLAS (the C math library): loading works, binding MLX would not.
    libm = ctypes.util.find_library("m")
    got = _probe(tmp_path, DFLASH_MLX_BLAS=libm)
    assert "exports no cblas_sgemm" in got["status"] and got["source"] is None


def _reset(monkeypatch, **env):
    monkeypatch.setattr(_blas, "status", "not attempted")
    monkeypatch.setattr(_blas, "loaded", None)
    monkeypatch.setattr(_blas, "source", None)
    monkeypatch.delenv("DFLASH_MLX_NO_BLAS", raising=False)
    monkeypatch.delenv("DFLASH_MLX_BLAS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_switched_off_by_environment(monkeypatch):
    _reset(monkeypatch, DFLASH_MLX_NO_BLAS="1")
    assert _blas.load_openblas() is None and _blas.status.startswith("off")


def test_too_late_after_mlx(monkeypatch):
    import mlx.core  # noqa: F401  (in this process mlx is loaded already)

    _reset(monkeypatch)
    assert _blas.load_openblas() is None and _blas.status.startswith("skipped: mlx.core was imported")


def test_too_late_warns_once_when_a_model_loads(monkeypatch):
    import warnings

    import mlx.core  # noqa: F401

    _reset(monkeypatch)
    _blas.load_openblas()
    monkeypatch.setattr(_blas, "_warned", False)
    with pytest.warns(RuntimeWarning, match="import dflash_mlx first"):
        _blas.warn_if_skipped()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _blas.warn_if_skipped()  # once per process
        monkeypatch.setattr(_blas, "_warned", False)
        monkeypatch.setattr(_blas, "status", "loaded OpenBLAS (x)")
        _blas.warn_if_skipped()  # nothing to say when the fast BLAS is in


def test_missing_choice_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_blas, "find_debian_openblas", lambda: None)
    monkeypatch.setattr(_blas, "find_pip_openblas", lambda: None)
    for wanted, hint in (("debian", "libopenblas0-pthread"), ("pip", "cvxopt"), ("", "pip install cvxopt")):
        _reset(monkeypatch, DFLASH_MLX_BLAS=wanted)
        blas, why = _blas._choose()
        assert blas is None and why.startswith("not found") and hint in why


# -- pip alone ----------------------------------------------------------------------------------------------------
def _blas_requirement() -> str:
    """The BLAS line of this package's own dependencies (what `pip install dflash-mlx` brings)."""
    reqs = [r for r in importlib.metadata.requires("dflash-mlx") or [] if r.startswith("cvxopt")]
    assert reqs, "dflash-mlx does not depend on the cvxopt wheel (pyproject.toml)"
    return reqs[0].split(";")[0].strip()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pip BLAS is for MLX's Linux CPU backend")
def test_fresh_venv_gets_fast_blas_from_pip(tmp_path):
    """A venv without system site-packages, with mlx[cpu] and the package's BLAS dependency from PyPI (or pip's
    cache): the loader finds the pip OpenBLAS (Debian's is hidden with DFLASH_MLX_BLAS=pip where it is installed)
    and a GEMM runs many times faster than on MLX's bundled BLAS in the same venv."""
    import mlx.core as mx

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check",
         f"mlx[cpu]=={mx.__version__}", _blas_requirement()],
        capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    hide = {"DFLASH_MLX_BLAS": "pip"} if find_debian_openblas() is not None else {}
    fast = _probe(tmp_path, str(python), **hide)
    bundled = _probe(tmp_path, str(python), DFLASH_MLX_NO_BLAS="1")
    assert fast["source"] == "OpenBLAS from the cvxopt wheel", fast["status"]
    assert str(venv) in fast["status"] and bundled["status"].startswith("off")
    # A ratio measured in the same venv, not a speed threshold: OpenBLAS is 20-40x faster here; 3x leaves room
    # for a loaded machine.
    assert bundled["seconds"] / fast["seconds"] > 3, (bundled, fast)
