"""Drafter checkpoints in the z-lab layout: `config.json` + `model.safetensors`, read and written with PyTorch.

The config is dflash-mlx's normalized DFlash config (`DFlashConfig.to_dict`, a Qwen3 config with `dflash_config`);
the weights carry no `model.` prefix. `dflash-mlx convert DIR OUT` turns such a folder into the quantized form the
engine loads fastest, and `dflash_mlx.load(target, drafter=DIR)` loads it as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from ..drafters.config import DFlashConfig
from ..errors import DFlashError
from .model import DraftModel

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def read_config(path: Path) -> DFlashConfig:
    file = Path(path) / CONFIG_NAME
    try:
        return DFlashConfig.from_dict(json.loads(file.read_text()))
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read the drafter config {file}: {e}") from None


def load_drafter(path: Path, device: Optional[torch.device] = None) -> DraftModel:
    """A `DraftModel` with the weights of the checkpoint folder `path` (float32 parameters)."""
    model = DraftModel(read_config(path))
    weights = load_file(str(Path(path) / WEIGHTS_NAME))
    weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise DFlashError(f"'{path}' does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(device) if device is not None else model


def save_drafter(model: DraftModel, out: Path, dtype: torch.dtype = torch.bfloat16,
                 metadata: Optional[Dict[str, str]] = None) -> Path:
    """Write `config.json` and `model.safetensors` (floating tensors in `dtype`) into `out`, atomically per file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in model.state_dict().items()}
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata=dict(metadata or {}, format="pt"))
    os.chmod(tmp, 0o644)  # readable like any model file (the temporary file is created private)
    os.replace(tmp, out / WEIGHTS_NAME)
    text = json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n"
    (out / (CONFIG_NAME + ".tmp")).write_text(text)
    os.replace(out / (CONFIG_NAME + ".tmp"), out / CONFIG_NAME)
    return out
