"""dflash-mlx: DFlash block-diffusion speculative decoding for mlx-lm models, lossless and faster."""

__version__ = "0.1.0"
