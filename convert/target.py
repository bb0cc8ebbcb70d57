"""Quantize or cast a safetensors target (an mlx-lm or Hugging Face model dir, or a hub repo) with mlx-lm's converter.

DFlash verifies against exactly these weights, so the drafter pairs with the quantized target like any other:

    dflash-mlx convert --target path/or/repo OUT --q-bits 4 [--q-group-size 64]

Greedy DFlash output equals mlx-lm's greedy output on the same quantized weights, up to near-ties where a
multi-row verify rounds differently from a one-row decode (README, "Losslessness"; tests/test_quantized.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from dflash_mlx.dtypes import dtype_name
from dflash_mlx.errors import DFlashError
from dflash_mlx.io_safety import check_output_dir, output_dir
from dflash_mlx.refs import is_repo_id



def convert_target(
    source: str,
    out: Union[str, Path],
    *,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    revision: Optional[str] = None,
    force: bool = False,
) -> Path:
    """Write `source` into `out` (atomically) quantized to `q_bits` and/or cast to `dtype`; returns `out`.

    Args:
        source: a local model directory with config.json and safetensors, or a Hugging Face repo id.
        out: the new output directory (must not exist, or be empty, unless `force`).
        q_bits: 4 or 8 (mlx-lm affine quantization of linear and embedding layers); None keeps floats.
        q_group_size: 32, 64 or 128.
        dtype: fp32, bf16 or fp16 for the floats (default: the source's own `torch_dtype`).
        revision: hub revision when `source` is a repo id.
        force: replace a non-empty `out` once the conversion has succeeded.
    """
    from mlx_lm.convert import convert as mlx_lm_convert

    if q_bits is not None and q_bits not in (4, 8):
        raise DFlashError(f"--q-bits must be 4 or 8, got {q_bits}")
    if q_group_size not in (32, 64, 128):
        raise DFlashError(f"--q-group-size must be 32, 64 or 128, got {q_group_size}")
    dtype = dtype_name(dtype) if dtype is not None else None
    if q_bits is None and dtype is None:
        raise DFlashError("nothing to do: give --q-bits 4|8 and/or --dtype fp32|bf16|fp16")
    local = Path(source).expanduser()
    # --force deletes the old `out`, and mlx-lm reads the source while writing: they must not overlap.
    sources = [local] if local.exists() else []
    out = check_output_dir(out, force, sources)
    if local.exists():
        if not local.is_dir():
            raise DFlashError(f"target '{source}' is a file; give the model's folder (the one holding "
                              "config.json and the *.safetensors files)")
        config_file = local / "config.json"
        if not config_file.is_file():
            raise DFlashError(f"target '{source}' has no config.json; pass an mlx-lm or Hugging Face model directory")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise DFlashError(f"cannot parse {config_file}: {e}") from None
        if q_bits is not None and (config.get("quantization") or config.get("quantization_config")):
            raise DFlashError(f"target '{source}' is already quantized; convert from the unquantized model")
    elif not is_repo_id(source):
        raise DFlashError(f"target '{source}' not found: give a local model directory or a hub repo id (org/name)")

    with output_dir(out, force, sources) as tmp:
        tmp.rmdir()  # mlx-lm's converter creates its output folder itself and refuses an existing one
        try:
            mlx_lm_convert(str(local) if local.exists() else source, str(tmp), quantize=q_bits is not None,
                           q_group_size=q_group_size, q_bits=q_bits, dtype=dtype, revision=revision)
        except (ValueError, FileNotFoundError) as e:
            raise DFlashError(f"mlx-lm could not convert '{source}': {' '.join(str(e).split())}") from None
        except OSError:
            raise  # a failed write: output_dir says what to do
        except Exception as e:  # hub errors (offline, unknown repo) come in many types
            raise DFlashError(f"could not convert '{source}': {type(e).__name__}: "
                              f"{' '.join(str(e).split())}") from None
    return out


def convert_model_command(source: Optional[str], out: Optional[Path], *, gguf: Optional[Path],
                          target: Optional[str], dtype: Optional[str], quantize: bool, q_bits: Optional[int],
                          q_group_size: int, revision: Optional[str], force: bool = False) -> Path:
    """`dflash-mlx convert --gguf FILE OUT` and `--target DIR_OR_REPO OUT`: check the flags, then convert."""
    if gguf is not None and target is not None:
        raise DFlashError("give either --gguf or --target, not both")
    flag = "--gguf" if gguf is not None else "--target"
    if source is None or out is not None:
        raise DFlashError(f"{flag} takes exactly one positional argument, the output directory: "
                          f"dflash-mlx convert {flag} {'FILE' if gguf is not None else 'DIR_OR_REPO'} OUT")
    out = Path(source)
    if quantize and q_bits is None:
        q_bits = 4
    if gguf is not None:
        from .gguf import convert_gguf

        return convert_gguf(gguf, out, dtype=dtype or "fp32", q_bits=q_bits, q_group_size=q_group_size,
                            force=force)
    return convert_target(target, out, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype, revision=revision,
                          force=force)
