"""Weight dtypes: every spelling a command or config accepts, in one table, with one error line for the rest."""

from __future__ import annotations

from .errors import DFlashError

# Each spelling -> MLX's name for the dtype.
SPELLINGS = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16"}


def dtype_name(name: str, flag: str = "--dtype") -> str:
    """MLX's name for a dtype spelling (`bf16` -> `bfloat16`); one clear error for anything else."""
    if name not in SPELLINGS:
        raise DFlashError(f"{flag} {name!r}: unsupported dtype {name!r}; choose fp32, bf16 or fp16")
    return SPELLINGS[name]


def mx_dtype(name: str, flag: str = "--dtype"):
    """The MLX dtype for a spelling (`bf16` -> `mx.bfloat16`)."""
    import mlx.core as mx  # here, so that naming a dtype does not load MLX (the `models` command stays light)

    return getattr(mx, dtype_name(name, flag))
