"""Drafter families: which kind of published drafter a checkpoint holds, and how to build it.

Every family shares the DFlash skeleton (tapped target features fused into context K/V, one forward pass per
block) and differs in config keys, extra tensors and how drafts are chosen. A family says whether a raw
`config.json` is one of its own (`claims`), which config class normalizes it and which drafter class it builds,
which parameters stay in float when the drafter is quantized (`keep_float`: small, sensitive weights), and how to
rename a checkpoint's tensors to the drafter's parameter names (`rename`).

`detect` asks the families in order; DFlash (the first generation) comes last and claims what no other family
does. The loader (`drafters.io`) and the converter go through this table only, so a new family is one module
listed in `_FAMILY_MODULES` that defines `FAMILY`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import mlx.core as mx

from ..errors import DFlashError
from .config import SPECULATORS, SPECULATORS_ONLY, DFlashConfig
from .dflash import DFlashDrafter


@dataclass(frozen=True)
class DrafterFamily:
    name: str  # as `--verbose` prints it, e.g. "DFlash 2"
    claims: Callable[[Dict[str, Any]], bool]  # raw config.json -> is it this family's?
    config_class: Type[DFlashConfig]  # `from_dict(raw)` normalizes, `to_dict()` writes our form
    drafter_class: Type[DFlashDrafter]
    keep_float: Tuple[str, ...] = ()  # parameter-path fragments left unquantized (`--quantize` keeps them float)
    rename: Optional[Callable[[Dict[str, mx.array], Any], Dict[str, mx.array]]] = None  # (weights, config)
    marks: Tuple[str, ...] = ()  # tensor-name fragments only this family's checkpoints hold (`marked_by`)


def _is_dflash(raw: Dict[str, Any]) -> bool:
    return True  # the fallback: `DFlashConfig.from_dict` and the loader say what is wrong with anything else


def speculators_tensors(weights: Dict[str, Any], config: DFlashConfig) -> Dict[str, Any]:
    """A speculators checkpoint's tensors under z-lab names: the target's copies dropped, and the head and `d2t`
    kept only for a reduced draft vocabulary (a full-vocabulary head is the target's own)."""
    if config.extra.get("layout") != SPECULATORS:
        return weights
    drop = set(SPECULATORS_ONLY) | (set() if config.draft_vocab_size else {"lm_head.weight", "d2t"})
    out = {k: v for k, v in weights.items() if k not in drop}
    if "d2t" in out:
        out["d2t"] = out["d2t"].astype(mx.int32)  # stored as int64 by PyTorch
    return out


DFLASH = DrafterFamily("DFlash", _is_dflash, DFlashConfig, DFlashDrafter, rename=speculators_tensors)

# Modules defining `FAMILY`, asked before DFlash in this order (imported on first use: each builds on drafter.py).
_FAMILY_MODULES: List[str] = [
    "dflash_mlx.drafters.dflash2",
    "dflash_mlx.drafters.dspark",
    "dflash_mlx.drafters.eagle3",
]

_families: Optional[List[DrafterFamily]] = None


def families() -> List[DrafterFamily]:
    """Every known family, most specific first, DFlash last."""
    global _families
    if _families is None:
        _families = [importlib.import_module(m).FAMILY for m in _FAMILY_MODULES] + [DFLASH]
    return _families


def detect(raw: Dict[str, Any]) -> DrafterFamily:
    """The family whose `claims` accepts this raw config.json."""
    return next(f for f in families() if f.claims(raw))


def family_of(config: DFlashConfig) -> DrafterFamily:
    """The family a normalized config belongs to (by its class)."""
    for family in families():
        if type(config) is family.config_class:
            return family
    raise DFlashError(f"no drafter family uses config class {type(config).__name__}")


def marked_by(weights: Dict[str, Any], family: DrafterFamily) -> Optional[Tuple[DrafterFamily, str]]:
    """Another family whose marks a tensor of `weights` carries (and that tensor's name), or None: a config that
    names one family over another family's tensors is inconsistent."""
    for other in families():
        if other is not family:
            for key in sorted(weights):
                if any(mark in key for mark in other.marks):
                    return other, key
    return None


def describe(drafter) -> str:
    """`--verbose`'s line on a drafter: its family and how its weights are held."""
    config = getattr(drafter, "config", None)
    known = any(type(config) is f.config_class for f in families())
    name = family_of(config).name if known else type(drafter).__name__
    return f"{name} drafter, {getattr(drafter, 'weights_form', 'weights as given')}"
