"""Reading an MTP block's tensors out of a target checkpoint, for both layouts (`mtp`, `mtp_deepseek`): which
weights files hold them, reading only those, quantizing what was stored quantized, loading strictly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError


def _no_mtp(where: str, tensors: str = "mtp.* tensors") -> DFlashError:
    return DFlashError(f"{where} has no MTP layers ({tensors}); use a DFlash drafter or 'lookup' (--draft lookup)")


def _header(path: Path) -> Dict[str, Any]:
    """A safetensors file's header (names, dtypes, shapes), read without its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _shards(folder: Path) -> Dict[str, List[str]]:
    """Tensor names per weights file: from the sharded index when there is one, else from each file's header."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        by_file: Dict[str, List[str]] = {}
        for key, name in json.loads(index.read_text()).get("weight_map", {}).items():
            by_file.setdefault(name, []).append(key)
        return by_file
    return {p.name: [k for k in _header(p) if k != "__metadata__"] for p in sorted(folder.glob("*.safetensors"))}


def _read(path: Path, keys: List[str]) -> Dict[str, mx.array]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="mlx") as f:
            return {k: mx.array(f.get_tensor(k)) for k in keys}
    except (ImportError, AttributeError, RuntimeError, TypeError):
        every = mx.load(str(path))
        return {k: every[k] for k in keys}


def _quantize(drafter: nn.Module, weights: Dict[str, mx.array], quantization: Optional[dict]) -> None:
    """Quantize the modules stored quantized (`<path>.scales`), with bits and group size read off their shapes."""
    mode = (quantization or {}).get("mode", "affine")
    stored = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}

    def predicate(path: str, module: nn.Module):
        if path not in stored or not hasattr(module, "to_quantized"):
            return False
        columns = module.weight.shape[-1]  # in-features of the float module
        packed, groups = weights[f"{path}.weight"].shape[-1], weights[f"{path}.scales"].shape[-1]
        return {"group_size": columns // groups, "bits": packed * 32 // columns, "mode": mode}

    if stored:
        nn.quantize(drafter, class_predicate=predicate)


def _load_weights(drafter: nn.Module, weights: Dict[str, mx.array], quantization: Optional[dict],
                  misfit: str) -> None:
    """Quantize what was stored quantized, load every tensor strictly; a misfit is one line (`misfit: why`)."""
    _quantize(drafter, weights, quantization)
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"{misfit}: {str(e).splitlines()[0]}") from e
    mx.eval(drafter.parameters())
