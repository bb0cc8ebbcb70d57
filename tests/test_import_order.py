"""Import order does not matter on Linux: `import mlx_lm` (or mlx) before `import dflash_mlx` still gets the fast
BLAS, thanks to the start-up hook dflash_mlx_blas.pth that pip installs with the package (setup.py, dflash_mlx/_blas.py).
Without it MLX binds its bundled reference BLAS when mlx.core loads, and fp32 matmuls run ~10-30x slower.

Each case runs in a fresh interpreter (the BLAS binds when mlx loads). These need the package installed by pip
(`pip install -e .` or a wheel): run from a bare source tree, there is no hook, and they fail saying so.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the BLAS hook is for MLX's Linux CPU backend")

ROOT = Path(__file__).resolve().parents[1]
HINT = "the start-up hook dflash_mlx_blas.pth is not installed here: reinstall with `pip install -e .`"

# mlx_lm first, dflash_mlx second; then what BLAS is mapped into the process and how fast a fp32 1024^3 GEMM runs.
_MLX_FIRST = r"""
import json, os, time
import mlx_lm
import mlx.core as mx
import dflash_mlx
from dflash_mlx import _blas
mx.set_default_device(mx.cpu)
a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
mx.eval(a @ b)
times = []
for _ in range(3):
    t = time.perf_counter()
    mx.eval(a @ b)
    times.append(time.perf_counter() - t)
maps = open("/proc/self/maps").read()
print(json.dumps({"status": _blas.status, "loaded": _blas.loaded,
                  "mapped": bool(_blas.loaded) and os.path.realpath(_blas.loaded) in maps, "seconds": min(times)}))
"""


def _run(code: str, **env) -> dict:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_MLX_")}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=180, cwd="/")  # not the checkout: the installed package, found through its install
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hook_installed() -> bool:
    return any((Path(p) / "dflash_mlx_blas.pth").is_file()
               for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path})


def test_mlx_lm_first_still_gets_the_fast_blas():
    from dflash_mlx._blas import _choose

    if _choose()[0] is None:
        pytest.skip("no OpenBLAS on this machine (cvxopt wheel or libopenblas0-pthread)")
    fast = _run(_MLX_FIRST)
    assert fast["status"].startswith("loaded"), f"{fast['status']}: {HINT}" if not _hook_installed() else fast
    assert fast["mapped"], fast
    # The same order with the hook off: MLX's bundled reference BLAS. A ratio, not a speed threshold: 25-30x here
    # (160 against 5.6 GFLOP/s); 3x leaves room for a loaded machine.
    slow = _run(_MLX_FIRST, DFLASH_MLX_NO_BLAS="1")
    assert slow["status"].startswith("off") and not slow["mapped"], slow
    assert slow["seconds"] / fast["seconds"] > 3, (slow, fast)


def test_the_hook_imports_nothing_heavy_at_start_up():
    """Python starts without importing mlx or the dflash_mlx package: the hook only waits for mlx's first import."""
    # dflash_mlx._blas is the hook's own module: reading it from sys.modules imports nothing.
    code = ("import json, sys; blas = sys.modules.get('dflash_mlx._blas'); "
            "heavy = sorted(m for m in ('mlx', 'mlx.core', 'dflash_mlx', 'numpy') if m in sys.modules); "
            "print(json.dumps({'heavy': heavy, 'hooked': blas is not None and blas._BeforeMlx in sys.meta_path}))")
    got = _run(code)
    assert got["hooked"], HINT
    assert got["heavy"] == [], got
    assert _run(code, DFLASH_MLX_NO_BLAS="1")["hooked"] is False


def test_wheel_ships_the_hook(tmp_path):
    """`pip wheel .` puts dflash_mlx_blas.pth at the top of the wheel (site-packages once installed)."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "dflash_mlx_blas.pth", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("dflash_mlx", "convert", "metal"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"wheel build failed (needs setuptools>=77: pip install -e .[dev]):\n{proc.stderr}"
    wheel = next(out.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "dflash_mlx_blas.pth" in names, names[:20]
    assert zipfile.ZipFile(wheel).read("dflash_mlx_blas.pth") == (ROOT / "dflash_mlx_blas.pth").read_bytes()
