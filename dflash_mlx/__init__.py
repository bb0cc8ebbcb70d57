"""dflash-mlx: DFlash block-diffusion speculative decoding for mlx-lm models, lossless and faster.

    from dflash_mlx import load, generate, stream_generate
"""

__version__ = "0.1.0"

# First, before anything imports mlx: route MLX's CPU matmuls through OpenBLAS where Debian provides it.
from . import _blas  # noqa: E402

_blas.load_openblas()

from .api import DFlashResponse, generate, load, stream_generate  # noqa: E402
from .errors import DFlashError  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "DFlashResponse", "DFlashError", "__version__"]
