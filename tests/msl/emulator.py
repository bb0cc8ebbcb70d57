"""MSL emulator: runs an `mx.fast.metal_kernel` kernel on the CPU, with GPU semantics, so Linux CI executes it.

Usage (tests):

    from msl import emulator
    from dflash_mlx import metal

    k = metal.kernel(name="myexp", input_names=["inp"], output_names=["out"], source=SRC)
    with emulator.installed():      # every dflash_mlx.metal.kernel runs here; metal.available() is True
        (out,) = k(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                   output_shapes=[a.shape], output_dtypes=[a.dtype])

    emulator.metal_kernel(...)      # the same thing without the factory: mx.fast.metal_kernel's signature
    with emulator.rebuilt(["mlx_lm.models.gated_delta"]) as (gd,):   # mlx-lm's own kernels, emulated
        y, state = gd.gated_delta_kernel(q, k, v, g, beta, state)

What happens on a call: the kernel text is linted (source.lint), the signature MLX would generate is written in
front of the body (source.signature), and header + signature + body are compiled with g++ against msl_shim.h
(cached on disk by a hash of all the text and the flags, so each distinct kernel compiles once per machine and
flag set; `contraction("fast")` compiles with multiply-adds fused wherever g++ can). The grid then runs
twice through ctypes, threads as fibers: forward order with outputs pre-filled with one poison value, reverse
order (threadgroups and threads) with another. The call raises `Fault` when
- the two runs differ (a missing threadgroup_barrier, or threadgroups that depend on each other),
- an output element keeps its poison in both runs (never written; pass init_value if that is intended),
- a run deadlocks (a barrier not reached by every thread), a SIMD collective is reached by only some lanes,
  threadgroup memory exceeds 32 KiB, or an access falls outside a buffer (guard pages) or a threadgroup array.
`LintError` (Metal forbids it) and `CompileError` (g++'s message, with body line numbers) come before any run.
A run that takes longer than DFLASH_MLX_MSL_TIMEOUT seconds (default 120) is stopped and reported as a Fault
rather than hanging. Set DFLASH_MLX_MSL_CACHE to choose the cache folder (default: <tmp>/dflash-mlx-msl-<uid>).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import dtypes
from .source import (LintError, Param, for_gcc, instantiation, kernel_name, lint, signature, template_text,
                     used_attributes)

__all__ = ["CompileError", "Fault", "LintError", "metal_kernel", "installed", "rebuilt", "contraction",
           "EmulatedKernel"]

HERE = Path(__file__).resolve().parent
GXX_FLAGS = ["-std=gnu++17", "-O1", "-fPIC", "-shared", "-fsingle-precision-constant", "-fno-strict-aliasing",
             "-fno-exceptions", "-fno-rtti",
             # Metal's attributes ([[buffer(0)]], [[kernel]]) and clang pragmas mean nothing to g++
             "-Wno-attributes", "-Wno-unknown-pragmas", "-Wno-narrowing",
             # reading a variable before it is set, or falling off the end of a function: undefined on a GPU too
             "-Werror=uninitialized", "-Werror=return-type"]
STACK_BYTES = 256 * 1024  # per GPU thread; only the pages a thread touches are ever backed
TIMEOUT_ENV = "DFLASH_MLX_MSL_TIMEOUT"  # seconds one run of a launch may take (default 120)
CFLAGS_ENV = "DFLASH_MLX_MSL_CFLAGS"  # extra g++ flags


def _fma_isa() -> list[str]:
    """The flag that gives g++ fused multiply-add instructions: x86-64's baseline has none (aarch64's has)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        has_fma = " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        has_fma = False
    return ["-mfma"] if has_fma else []


# Multiply-add contraction, one of the compiler's freedoms that the Metal compiler may also take. "off": every
# product is rounded before it is added (the default). "fast": g++ fuses a * b + c into one fma wherever it can,
# across statements too, so a kernel whose results depend on what gets fused shows it. Each flag set compiles and
# caches its own objects (the flags are part of the cache key).
# (At -O1, g++ forms fused multiply-adds only with -fexpensive-optimizations, which -O2 would turn on.)
CONTRACTION = {"off": ["-ffp-contract=off"],
               "fast": ["-ffp-contract=fast", "-fexpensive-optimizations", *_fma_isa()]}
_contraction = "off"


class CompileError(RuntimeError):
    """g++ rejected the kernel."""


class Fault(RuntimeError):
    """The kernel ran but broke a GPU rule (race, deadlock, divergent collective, unwritten output, bad access)."""


class _LaunchArgs(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_int64 * 3),
        ("group", ctypes.c_int64 * 3),
        ("reverse", ctypes.c_int32),
        ("nbufs", ctypes.c_int32),
        ("host", ctypes.POINTER(ctypes.c_void_p)),
        ("nbytes", ctypes.POINTER(ctypes.c_int64)),
        ("writable", ctypes.POINTER(ctypes.c_int32)),
        ("offsets", ctypes.POINTER(ctypes.c_int64)),
        ("names", ctypes.POINTER(ctypes.c_char_p)),
        ("stack_bytes", ctypes.c_int64),
        ("timeout_ms", ctypes.c_int64),
        ("err", ctypes.c_void_p),
        ("err_len", ctypes.c_int64),
    ]


def timeout_ms() -> int:
    return int(float(os.environ.get(TIMEOUT_ENV, "120")) * 1000)


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"dflash-mlx-msl-{os.getuid()}"
    path = Path(os.environ.get("DFLASH_MLX_MSL_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


_SHIM_TEXT: Optional[str] = None
_LIBS: dict[str, ctypes.CDLL] = {}


def _shim_text() -> str:
    """Every header a kernel compiles against: part of each cache key, so editing the shim recompiles."""
    global _SHIM_TEXT
    if _SHIM_TEXT is None:
        files = sorted(HERE.glob("*.h")) + sorted((HERE / "include").iterdir())
        _SHIM_TEXT = "".join(f.read_text() for f in files)
    return _SHIM_TEXT


def gxx_flags() -> list[str]:
    """GXX_FLAGS, the current contraction's flags (see `contraction`), then DFLASH_MLX_MSL_CFLAGS (e.g. "-O0 -g" to
    debug a kernel, "-DMSL_UCONTEXT" for the portable fiber switch)."""
    return GXX_FLAGS + CONTRACTION[_contraction] + os.environ.get(CFLAGS_ENV, "").split()


def fma_contraction_fuses() -> bool:
    """Whether "fast" contraction really fuses here (an FMA instruction set g++ may use)."""
    return platform.machine() not in ("x86_64", "AMD64") or bool(_fma_isa())


def current_contraction() -> str:
    """The contraction kernels compile with now: "off" or "fast"."""
    return _contraction


@contextmanager
def contraction(mode: str) -> Iterator[None]:
    """Compile every kernel called inside the block with multiply-add contraction `mode` ("off" or "fast")."""
    global _contraction
    if mode not in CONTRACTION:
        raise ValueError(f"contraction must be one of {sorted(CONTRACTION)}, not {mode!r}")
    previous, _contraction = _contraction, mode
    try:
        yield
    finally:
        _contraction = previous


def compile_unit(unit: str) -> ctypes.CDLL:
    """Compile a translation unit (cached by a hash of it, the shim and the flags) and load it."""
    flags = gxx_flags()
    key = hashlib.sha256("\0".join([unit, _shim_text(), " ".join(flags)]).encode()).hexdigest()[:24]
    lib = _LIBS.get(key)
    if lib is not None:
        return lib
    so = cache_dir() / f"k{key}.so"
    if not so.exists():
        src = cache_dir() / f"k{key}.{os.getpid()}.cpp"
        tmp = cache_dir() / f"k{key}.{os.getpid()}.so"
        src.write_text(unit)
        cmd = ["g++", *flags, "-I", str(HERE), "-I", str(HERE / "include"), str(src), "-o", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        except FileNotFoundError:
            raise CompileError("g++ not found: the MSL emulator compiles kernels with g++ (apt-get install g++)")
        if proc.returncode != 0:
            src.unlink(missing_ok=True)
            lines = proc.stderr.replace(str(src), "<kernel>").splitlines()
            raise CompileError("g++ rejected the kernel:\n" + "\n".join(lines[:40]))
        src.unlink(missing_ok=True)
        os.replace(tmp, so)  # atomic: concurrent test processes never load a half-written file
    lib = ctypes.CDLL(str(so))
    lib.msl_launch.argtypes = [ctypes.POINTER(_LaunchArgs)]
    lib.msl_launch.restype = ctypes.c_int
    _LIBS[key] = lib
    return lib


def _entry_point(func: str, template_args: str, params: list[Param], attributes: list[str]) -> str:
    args = []
    for k, p in enumerate(params):
        cast = f"({'' if p.is_output else 'const '}{p.ctype}*)b[{k}]"
        args.append(f"*{cast}" if p.by_ref else cast)
    args += [f"t.{a}" for a in attributes]
    call = f"{func}<{template_args}>" if template_args else func
    return (
        "static void msl_kernel_thread() {\n"
        "  void** b = msl_rt::g_bufs;\n"
        "  const msl_rt::Thread& t = msl_rt::cur();\n"
        "  (void)b; (void)t;\n"
        f"  {call}(\n    " + ",\n    ".join(args) + ");\n"
        "}\n"
        'extern "C" int msl_launch(const msl_rt::LaunchArgs* a) { return msl_rt::launch(a, msl_kernel_thread); }\n'
    )


def _input_buffer(x: mx.array, row_contiguous: bool) -> tuple[np.ndarray, list[int], int]:
    """Raw bits as the kernel sees them, the strides (elements) MLX would pass for `x`, and the element of the
    buffer the kernel's pointer is at.

    A row-contiguous input (or any input with ensure_row_contiguous) is its plain C-order bits. Otherwise the
    buffer spans every element the strides reach, with the array's elements at their strided places and poison
    in the gaps, so a strided view (broadcast, transposed, sliced, reversed) reads exactly as it would on the GPU.
    """
    bits = dtypes.to_bits(x)
    if x.ndim == 0 or row_contiguous or memoryview(x).c_contiguous:
        strides = [int(s) for s in np.cumprod([1, *x.shape[::-1]])[:-1][::-1]] if x.ndim else []
        return np.ascontiguousarray(bits).reshape(-1), strides, 0
    strides = [s // x.itemsize for s in memoryview(x).strides]
    low = sum(s * (n - 1) for s, n in zip(strides, x.shape) if s < 0)
    high = sum(s * (n - 1) for s, n in zip(strides, x.shape) if s > 0)
    span = np.full(high - low + 1, dtypes.poison(x.dtype, 0), dtype=bits.dtype)
    view = np.lib.stride_tricks.as_strided(span[-low:], shape=x.shape, strides=[s * span.itemsize for s in strides])
    view[...] = bits
    return span, strides, -low


class EmulatedKernel:
    """What `metal_kernel` returns: called exactly like the kernel `mx.fast.metal_kernel` returns."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options: Optional[dict] = None, check_order: bool = True, stack_bytes: int = STACK_BYTES):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        lint(name, source, header)
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous, self.atomic_outputs = ensure_row_contiguous, atomic_outputs
        self.check_order, self.stack_bytes = check_order, stack_bytes
        self._header_gcc, next_site = for_gcc(header)
        self._source_gcc, _ = for_gcc(source, next_site)

    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Optional[list] = None, init_value: Optional[float] = None, verbose: bool = False,
                 stream: Any = None) -> list[mx.array]:
        for got, want, what in ((len(inputs), len(self.input_names), "inputs"),
                                (len(output_shapes), len(self.output_names), "output_shapes"),
                                (len(output_dtypes), len(self.output_names), "output_dtypes")):
            if got != want:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got size {got}.")
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        template = list(template or [])
        for tname, value in template:
            if not isinstance(value, (bool, int, mx.Dtype)):
                raise ValueError("[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`.")
        params_text, args_text = template_text(template)
        func = kernel_name(self.name, args_text, arrays, list(output_dtypes))
        sig, params = signature(func, self.source, self.input_names, arrays, self.output_names, list(output_dtypes),
                                params_text, self.atomic_outputs)
        if verbose:
            text = f"{self.header}{sig}{self.source}\n}}\n{instantiation(func, args_text)}"
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        sig_gcc, _ = for_gcc(sig)
        unit = (
            '#include "msl_shim.h"\nusing namespace metal;\n'
            f'#line 1 "{self.name}.header"\n{self._header_gcc}\n'
            f'#line 1 "{self.name}.signature"\n{sig_gcc}'
            f'#line 1 "{self.name}.source"\n{self._source_gcc}\n}}\n'
            f'#line 1 "{self.name}.entry"\n' + _entry_point(func, args_text, params, used_attributes(self.source))
        )
        lib = compile_unit(unit)
        return self._run(lib, arrays, params, [tuple(s) for s in output_shapes], list(output_dtypes), grid,
                         threadgroup, init_value)

    def _buffers(self, arrays: list[mx.array], params: list[Param]) -> list[tuple[str, np.ndarray, int]]:
        """(name, bits, byte offset of the kernel's pointer) for every input-side parameter, in signature order."""
        laid_out = [_input_buffer(x, self.ensure_row_contiguous) for x in arrays]
        out = []
        for p in params:
            if p.is_output:
                continue
            x, (data, strides, first) = arrays[p.source], laid_out[p.source]
            if p.role == "data":
                out.append((p.name, data, first * data.itemsize))
                continue
            value = {"_shape": np.array(x.shape, np.int32), "_strides": np.array(strides, np.int64),
                     "_ndim": np.array([x.ndim], np.int32)}[p.role]
            out.append((p.name, value, 0))
        return out

    def _run(self, lib, arrays, params, shapes, out_dtypes, grid, threadgroup, init_value) -> list[mx.array]:
        for d in out_dtypes:
            dtypes.check_supported(d)
        ins = self._buffers(arrays, params)
        group = [max(1, min(int(t), int(g))) for t, g in zip(threadgroup, grid)]
        runs = []
        for run in (0, 1) if self.check_order else (0,):
            outs = []
            for shape, d in zip(shapes, out_dtypes):
                fill = dtypes.poison(d, run) if init_value is None else dtypes.value_bits(init_value, d)
                outs.append(np.full(int(np.prod(shape, dtype=np.int64)), fill, dtype=dtypes.bits_dtype(d)))
            if all(g > 0 for g in grid):
                self._launch(lib, ins, outs, grid, group, reverse=run == 1)
            runs.append(outs)
        results = []
        for i, (name, shape, d) in enumerate(zip(self.output_names, shapes, out_dtypes)):
            first = runs[0][i]
            if init_value is None and self.check_order:
                unwritten = (first == dtypes.poison(d, 0)) & (runs[1][i] == dtypes.poison(d, 1))
                if unwritten.any():
                    at = np.unravel_index(int(np.argmax(unwritten)), shape) if shape else ()
                    raise Fault(f"kernel {self.name!r}: output {name!r} has {int(unwritten.sum())} of {first.size} "
                                f"elements never written, or computed from their own unwritten value (first at index "
                                f"{tuple(int(v) for v in at)}); pass init_value if the kernel relies on a start value")
            if self.check_order:
                self._compare_orders(name, shape, d, first, runs[1][i])
            results.append(dtypes.from_bits(first, d, shape))
        return results

    def _compare_orders(self, name, shape, d, fwd: np.ndarray, rev: np.ndarray) -> None:
        differ = fwd != rev
        if self.atomic_outputs and dtypes.is_float(d):  # float atomics add in thread order: rounding differs
            a, b = dtypes.values(fwd, d).astype(np.float64), dtypes.values(rev, d).astype(np.float64)
            differ = ~np.isclose(a, b, rtol=1e-3, atol=1e-5, equal_nan=True)
        if differ.any():
            k = int(np.argmax(differ))
            at = tuple(int(v) for v in np.unravel_index(k, shape)) if shape else ()
            a, b = dtypes.values(fwd[k:k + 1], d)[0], dtypes.values(rev[k:k + 1], d)[0]
            raise Fault(f"kernel {self.name!r}: output {name!r} depends on thread order: {int(differ.sum())} elements "
                        f"differ between the forward and the reverse run (first at index {at}: {a} vs {b}); a "
                        f"missing threadgroup_barrier, a read of an output before it is written, or threadgroups "
                        f"that depend on each other")

    def _launch(self, lib, ins, outs, grid, group, reverse: bool) -> None:
        bufs = [(name, data, 0, offset) for name, data, offset in ins]
        bufs += [(name, out, 1, 0) for name, out in zip(self.output_names, outs)]
        n = len(bufs)
        if n > 64:
            raise ValueError("the MSL emulator passes at most 64 buffers")
        host = (ctypes.c_void_p * n)(*[b[1].ctypes.data for b in bufs])
        nbytes = (ctypes.c_int64 * n)(*[b[1].nbytes for b in bufs])
        writable = (ctypes.c_int32 * n)(*[b[2] for b in bufs])
        offsets = (ctypes.c_int64 * n)(*[b[3] for b in bufs])
        names = (ctypes.c_char_p * n)(*[b[0].encode() for b in bufs])
        err = ctypes.create_string_buffer(4096)
        args = _LaunchArgs((ctypes.c_int64 * 3)(*[int(g) for g in grid]), (ctypes.c_int64 * 3)(*group),
                           int(reverse), n, host, nbytes, writable, offsets, names, self.stack_bytes, timeout_ms(),
                           ctypes.cast(err, ctypes.c_void_p), len(err))
        if lib.msl_launch(ctypes.byref(args)) != 0:
            order = "reverse" if reverse else "forward"
            raise Fault(f"kernel {self.name!r} ({order} run): {err.value.decode(errors='replace')}")


def supported() -> bool:
    """The emulator runs on Linux (fibers, guard pages, a thread-directed watchdog) and needs g++."""
    return sys.platform.startswith("linux") and shutil.which("g++") is not None


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = "",
                 ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options: Optional[dict] = None) -> EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel` that runs on the emulator."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
                          compile_options)


@contextmanager
def rebuilt(module_names: Sequence[str]) -> Iterator[list]:
    """Modules that build their kernels with mx.fast.metal_kernel at import (mlx-lm's), reloaded with the emulator
    standing in for it and Metal reported present; reloaded as they were on exit. For tests only: other code
    holding the modules' functions sees the emulated kernels while the block runs."""
    modules = [importlib.import_module(name) for name in module_names]
    real_factory, real_available = mx.fast.metal_kernel, mx.metal.is_available
    mx.fast.metal_kernel, mx.metal.is_available = metal_kernel, lambda: True
    try:
        emulated = [importlib.reload(m) for m in modules]
    finally:
        mx.fast.metal_kernel, mx.metal.is_available = real_factory, real_available
    try:
        yield emulated
    finally:
        for m in modules:
            importlib.reload(m)


@contextmanager
def installed(contract: str = "off") -> Iterator[None]:
    """Route every `dflash_mlx.metal.kernel` through the emulator inside the block, compiled with multiply-add
    contraction `contract` ("off" or "fast", see `contraction`)."""
    from dflash_mlx import metal

    with metal.use_backend(metal_kernel), contraction(contract):
        yield
