"""Convert a z-lab DFlash drafter checkpoint (local or on the Hub) into the form dflash-mlx loads fastest.

The output is a directory with a normalized `config.json` (`model_type: "dflash"`, sorted keys) and one
`model.safetensors` in the chosen dtype, optionally quantized. Converting the same input twice gives
byte-identical files. Reading and checking is shared with `dflash_mlx.drafters.io.load_drafter`.
The directory appears only when complete (a temporary folder renamed into place); a non-empty one is replaced
only with `force`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from dflash_mlx.drafters.io import (
    check_quantization,
    parse_dtype,
    quantize_drafter,
    read_drafter,
    resolve_checkpoint,
    save_drafter,
)
from dflash_mlx.errors import DFlashError
from dflash_mlx.io_safety import check_output_dir, output_dir


def convert_drafter(
    source: str,
    out: Union[str, Path],
    *,
    dtype: str = "bfloat16",
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    revision: Optional[str] = None,
    force: bool = False,
) -> Path:
    """Convert `source` (a drafter directory or Hub repo id) into `out`; returns the output directory.

    `out` must be new or empty unless `force`, which replaces it once the conversion has succeeded.
    """
    target_dtype = parse_dtype(dtype)  # bad flags fail before any download
    if q_bits is not None:
        check_quantization(q_bits, q_group_size)
    out = Path(out).expanduser()
    local = Path(source).expanduser()
    # The source tensors are read lazily while `out` is written, and --force deletes the old `out`: the two
    # must not overlap (checked before any download, and again on the downloaded snapshot).
    check_output_dir(out, force, sources=[local] if local.exists() else [])
    path = resolve_checkpoint(source, revision)
    drafter = read_drafter(path)
    if drafter.config.quantization:
        raise DFlashError(f"'{source}' is already quantized; convert from the original (unquantized) checkpoint")
    drafter.set_dtype(target_dtype)
    if q_bits is not None:
        quantize_drafter(drafter, q_bits, q_group_size)
    with output_dir(out, force, sources=[path]) as tmp:
        save_drafter(drafter, tmp)
    return out
