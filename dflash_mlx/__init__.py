"""dflash-mlx: DFlash block-diffusion speculative decoding for mlx-lm models, lossless and faster.

    from dflash_mlx import load, generate, stream_generate
"""

__version__ = "0.1.0"

# First, before anything imports mlx: route MLX's CPU matmuls through OpenBLAS where Debian provides it.
from . import _blas  # noqa: E402

_blas.load_openblas()

from .errors import DFlashError  # noqa: E402

_API = ("DFlashResponse", "generate", "load", "stream_generate")


def __getattr__(name):
    # The API (and mlx with it) loads on first use: the CLI starts at once, so Ctrl-C and --help stay quick.
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")


__all__ = ["load", "generate", "stream_generate", "DFlashResponse", "DFlashError", "__version__"]
