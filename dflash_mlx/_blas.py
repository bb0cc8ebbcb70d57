"""Give MLX's Linux CPU backend an optimized BLAS instead of the reference BLAS its wheel bundles.

The `mlx[cpu]` wheel links a reference BLAS (fp32 GEMM ≈ 2–4 GFLOP/s), so a k-token verify costs about k one-token
steps and speculative decoding cannot win on CPU. libmlx.so leaves `cblas_sgemm` undefined and the dynamic loader
searches the global scope before libmlx's own dependencies, so a library loaded with RTLD_GLOBAL before `mlx.core`
that exports unprefixed `cblas_*` symbols takes over every fp32 GEMM. This only works before mlx is imported:
`dflash_mlx/__init__.py` calls `load_openblas()` first thing, and so, earlier still, does the start-up hook
`dflash_mlx_blas.pth` that pip installs into site-packages with the package (setup.py): it loads this file on its
own as `dflash_mlx._blas` (stdlib only, nothing else of dflash_mlx, no mlx) and calls `startup()` as Python starts,
which loads the BLAS the moment anything first imports mlx, so `import mlx_lm` before `import dflash_mlx` keeps the
fast BLAS. Run from a source tree without an install, only
the import does it, and `warn_if_skipped` warns when mlx came first.

Where the library comes from, first found wins:
  1. the OpenBLAS inside the `cvxopt` wheel, a Linux dependency of this package, so `pip install` alone brings it:
     unprefixed `cblas_*` symbols, kernels picked at run time for the CPU (DYNAMIC_ARCH), with the gfortran runtime
     it needs bundled beside it. Single-threaded, which on a busy machine beats a threaded BLAS whose threads wait
     for cores. (OpenBLAS's own `scipy-openblas32` wheel prefixes its symbols with `scipy_`; `cmeel-openblas` is
     built for AVX-512 only and needs a system gfortran: neither works as is.)
  2. Debian's pthread OpenBLAS (`libopenblas0-pthread`), when installed.
`DFLASH_MLX_BLAS` picks one: `debian`, `pip`, or paths of shared libraries separated by `:` (loaded in that order,
for another BLAS such as MKL). `DFLASH_MLX_NO_BLAS=1` turns all of this off. bf16, fp16 and quantized matmuls do
not use BLAS on CPU. Measured effect: `python benchmarks/cpu_blas.py` (docs/cpu-performance.md).
"""

from __future__ import annotations

# Only what Python has imported already as it starts: the start-up hook runs this file in every interpreter, so
# ctypes, glob, platform and importlib.util are imported where they are used (docs/cpu-performance.md, start-up).
import collections
import os
import sys

_DEBIAN_SUBDIR = "openblas-pthread/libblas.so.3"
_PIP_PACKAGE = "cvxopt"


class Blas(collections.namedtuple("Blas", ["name", "libraries"])):
    """A BLAS to load: its name for messages and its shared libraries (a tuple) in load order (dependencies first)."""

    __slots__ = ()


# What happened at import: the BLAS loaded (name and main library), or why none was.
status: str = "not attempted"
loaded: Optional[str] = None
source: Optional[str] = None


def find_debian_openblas() -> Optional[Blas]:
    """Debian/Ubuntu's pthread OpenBLAS (package libopenblas0-pthread), for this machine's multiarch triple."""
    import glob
    import platform

    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    candidates = [f"/usr/lib/{arch}-linux-gnu/{_DEBIAN_SUBDIR}", f"/usr/lib/{_DEBIAN_SUBDIR}",
                  f"/usr/lib64/{_DEBIAN_SUBDIR}"]
    candidates += sorted(glob.glob(f"/usr/lib/*-linux-gnu/{_DEBIAN_SUBDIR}"))
    path = next((p for p in candidates if os.path.exists(p)), None)
    return Blas("Debian OpenBLAS", (path,)) if path else None


def find_pip_openblas() -> Optional[Blas]:
    """The OpenBLAS that the cvxopt wheel bundles in `cvxopt.libs/`, found without importing cvxopt."""
    import glob
    import importlib.util

    try:
        spec = importlib.util.find_spec(_PIP_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = os.path.join(os.path.dirname(list(spec.submodule_search_locations)[0]), f"{_PIP_PACKAGE}.libs")
    # auditwheel renamed each bundled library and the names its neighbours need, so loading them by path in
    # dependency order satisfies those needs without any search path.
    found = [sorted(glob.glob(os.path.join(libs, f"{stem}-*")))
             for stem in ("libquadmath", "libgfortran", "libopenblas")]
    if not found[2]:
        return None
    return Blas(f"OpenBLAS from the {_PIP_PACKAGE} wheel", tuple(f[0] for f in found if f))


def _choose() -> Tuple[Optional[Blas], str]:
    """The BLAS to load, or None and why not."""
    wanted = os.environ.get("DFLASH_MLX_BLAS", "").strip()
    if wanted == "debian":
        blas = find_debian_openblas()
        return blas, "" if blas else "not found: DFLASH_MLX_BLAS=debian but libopenblas0-pthread is not installed"
    if wanted == "pip":
        blas = find_pip_openblas()
        return blas, "" if blas else f"not found: DFLASH_MLX_BLAS=pip but the {_PIP_PACKAGE} wheel is not installed"
    if wanted:
        paths = tuple(p for p in wanted.split(":") if p)
        return (Blas("DFLASH_MLX_BLAS", paths), "") if paths else (None, "not found: DFLASH_MLX_BLAS names no library")
    blas = find_pip_openblas() or find_debian_openblas()
    return blas, "" if blas else f"not found (pip install {_PIP_PACKAGE}, or apt-get install libopenblas0-pthread)"


def _load(blas: Blas) -> Optional[str]:
    """Load every library of `blas` globally; the error text, or None on success."""
    import ctypes

    for path in blas.libraries:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return f"could not load {path}: {e}"
    if not hasattr(lib, "cblas_sgemm"):  # e.g. a build with prefixed symbols: MLX would not bind it
        return f"loaded {blas.libraries[-1]}, but it exports no cblas_sgemm: MLX keeps its bundled BLAS"
    return None


def load_openblas() -> Optional[str]:
    """Load a fast BLAS globally if we are on Linux, mlx is not imported yet, and it is not turned off."""
    global status, loaded, source
    if status != "not attempted":  # once per process
        return loaded
    if not sys.platform.startswith("linux"):
        status = "not Linux (MLX uses Accelerate or the GPU)"
    elif os.environ.get("DFLASH_MLX_NO_BLAS", "").strip() not in ("", "0"):
        status = "off (DFLASH_MLX_NO_BLAS is set)"
    elif "mlx.core" in sys.modules:
        # Too late: mlx already resolved its BLAS symbols. Import dflash_mlx before mlx to get the fast path.
        status = "skipped: mlx.core was imported before dflash_mlx"
    else:
        blas, why = _choose()
        if blas is None:
            status = why
        elif (error := _load(blas)) is not None:
            status = error
        else:
            loaded, source = blas.libraries[-1], blas.name
            status = f"loaded {blas.name} ({loaded})"
    if os.environ.get("DFLASH_MLX_DEBUG"):
        print(f"dflash-mlx: BLAS {status}", file=sys.stderr)
    return loaded


class _BeforeMlx:
    """A meta-path finder that, the first time anything imports mlx, loads the BLAS and steps aside (it finds no
    module itself). Waiting for that import rather than loading at start-up costs nothing to programs that never
    use mlx, and sees mlx and cvxopt wherever they are on sys.path (system site-packages are added to it only after
    a venv's .pth files have run)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            _unhook()
            try:
                load_openblas()
            except Exception:  # noqa: BLE001  (mlx then keeps its bundled BLAS; importing it must not fail)
                pass
        return None


def _unhook() -> None:
    try:
        sys.meta_path.remove(_BeforeMlx)
    except ValueError:
        pass


def startup() -> None:
    """The start-up hook (dflash_mlx_blas.pth): on Linux, arranges `load_openblas()` to run just before mlx is first
    imported. Never raises, so a failure cannot break the interpreter's start; nothing at all with DFLASH_MLX_NO_BLAS
    set, nor off Linux, and nothing loads in a program that does not import mlx."""
    try:
        if not sys.platform.startswith("linux") or os.environ.get("DFLASH_MLX_NO_BLAS", "").strip() not in ("", "0"):
            return
        if "mlx.core" not in sys.modules and _BeforeMlx not in sys.meta_path:
            sys.meta_path.insert(0, _BeforeMlx)
    except Exception:  # noqa: BLE001  (whatever it is, Python must start; `import dflash_mlx` says what went wrong)
        pass


def warn_if_skipped() -> None:
    """Once per process: a warning when the fast BLAS could not be loaded because mlx was imported first and MLX
    computes on the CPU (its reference BLAS is ~10x slower, and speculative decoding then cannot win)."""
    global _warned
    if _warned or not status.startswith("skipped"):
        return
    import warnings

    import mlx.core as mx

    if mx.default_device().type != mx.cpu:
        return
    _warned = True
    warnings.warn("mlx was imported before dflash_mlx, so MLX's CPU matmuls use its slow reference BLAS; import "
                  "dflash_mlx first (before mlx or mlx_lm)", RuntimeWarning, stacklevel=3)


_warned = False

