"""MSL emulation harness: runs dflash_mlx.metal kernels on the CPU with GPU semantics (tests only)."""
