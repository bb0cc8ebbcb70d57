"""Metal kernel sources for dflash-mlx, and the switch that decides whether they run.

Every kernel follows one pattern, as mlx-lm's own kernels do:

1. Metal source: a `*.metal` body in this folder, created with `kernel(...)` (below) using `dflash_common.h` as
   its header. Built once (a module-level constant), never inside the decode loop.
2. Reference: a pure-MLX function with the same signature and the same result; it runs everywhere (Linux CPU
   included) and is the definition the kernel must match.
3. Dispatcher: calls the kernel when `available()`, otherwise the reference.
4. Parity test: runs kernel and reference on the same inputs and compares them: on Metal on a Mac, through the
   MSL emulator (tests/msl) everywhere else.

Every kernel is created through one factory, `kernel(...)`, which takes `mx.fast.metal_kernel`'s arguments and
returns a callable with the same call arguments. On a Mac the call runs `mx.fast.metal_kernel`'s kernel (built on
first use, then reused). Tests on Linux route the same call through the MSL emulator (`tests/msl/`) with
`use_backend(factory)`, so every kernel executes in CI exactly as written.

Setting `DFLASH_MLX_NO_METAL=1` turns every kernel off, so the references run even on a Mac.
The sources ship as package data (`dflash_mlx.metal`), so `read_source` works from a wheel and from an
editable install alike.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from importlib import resources
from typing import Any, Callable, Iterator, Optional, Sequence

NO_METAL_ENV = "DFLASH_MLX_NO_METAL"

# A function with mx.fast.metal_kernel's signature that replaces it (the emulator, in tests); None: real Metal.
_backend: Optional[Callable[..., Any]] = None


def read_source(name: str) -> str:
    """Text of a kernel source or header in this package, e.g. `read_source("dflash_common.h")`."""
    source = resources.files(__name__).joinpath(name)
    if not source.is_file():
        raise FileNotFoundError(f"no Metal source {name!r} in {__name__}; is the package installed with its data?")
    return source.read_text(encoding="utf-8")


def available() -> bool:
    """True where Metal kernels may run: a Metal device (or a backend installed with `use_backend`) is present and
    DFLASH_MLX_NO_METAL is not set."""
    if os.environ.get(NO_METAL_ENV, "") not in ("", "0"):
        return False
    if _backend is not None:
        return True
    import mlx.core as mx

    return bool(mx.metal.is_available())


class Kernel:
    """A Metal kernel as `mx.fast.metal_kernel` describes it, run by the current backend.

    Cheap to create (nothing compiles until the first call), so kernels are module-level constants; each backend's
    kernel object is built once and reused.
    """

    def __init__(self, **spec: Any):
        self.spec = spec
        self.name = spec["name"]
        self._built: dict[int, tuple[Callable[..., Any], Any]] = {}

    def _for(self, factory: Callable[..., Any]) -> Any:
        built = self._built.get(id(factory))
        if built is None or built[0] is not factory:
            built = (factory, factory(**self.spec))
            self._built[id(factory)] = built
        return built[1]

    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[Any],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template: Optional[list] = None,
                 init_value: Optional[float] = None, verbose: bool = False, stream: Any = None) -> list:
        factory = _backend
        if factory is None:
            import mlx.core as mx

            factory = mx.fast.metal_kernel
        call = dict(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                    threadgroup=threadgroup, init_value=init_value, verbose=verbose)
        if template is not None:
            call["template"] = template
        if stream is not None:
            call["stream"] = stream
        return self._for(factory)(**call)


def kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = "",
           ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
           compile_options: Optional[dict] = None) -> Kernel:
    """The one way to create a kernel: `mx.fast.metal_kernel`'s arguments, and a result called like its kernel
    (inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value, verbose, stream)."""
    spec: dict[str, Any] = dict(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=source, header=header, ensure_row_contiguous=ensure_row_contiguous,
                                atomic_outputs=atomic_outputs)
    if compile_options is not None:
        spec["compile_options"] = compile_options
    return Kernel(**spec)


@contextmanager
def use_backend(factory: Callable[..., Any]) -> Iterator[None]:
    """Run every `Kernel` through `factory` (mx.fast.metal_kernel's signature) inside the block; `available()` is
    True there unless DFLASH_MLX_NO_METAL is set. Tests use it to run kernels on the emulator."""
    global _backend
    previous, _backend = _backend, factory
    try:
        yield
    finally:
        _backend = previous
