"""Short model names (`Qwen3.5-9B`, `gpt-oss-20b`, ...) resolved to an MLX target repo and its DFlash drafter.

The table itself is data: `registry.json` next to this module. `--quant` picks among the MLX conversions of a
target; each entry names a sensible default for its size.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Dict, Iterable, List, Optional

from ..errors import DFlashError


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    targets: Dict[str, str]  # quant -> MLX repo id
    default_quant: str
    drafter: str  # z-lab repo id
    thinking: bool = False
    upstream: Optional[str] = None
    architecture: Optional[str] = None  # the target's model_type, checked against the installed mlx-lm


def mlx_lm_supports(model_type: str) -> bool:
    """Whether the installed mlx-lm ships a module for this model_type (after its own renames)."""
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Resolved:
    name: str
    target: str
    drafter: str
    quant: str
    thinking: bool


@lru_cache(maxsize=1)
def entries() -> Dict[str, RegistryEntry]:
    raw = json.loads(resources.files("dflash_mlx.models").joinpath("registry.json").read_text())
    return {name: RegistryEntry(name=name, **spec) for name, spec in raw["models"].items()}


def names() -> List[str]:
    return list(entries())


def find(name: str) -> Optional[RegistryEntry]:
    """Exact or case-insensitive match; None when `name` is not a short name."""
    table = entries()
    if name in table:
        return table[name]
    lowered = {k.lower(): v for k, v in table.items()}
    return lowered.get(name.lower())


def suggest(name: str, n: int = 3, also: Iterable[str] = ()) -> List[str]:
    lowered = {k.lower(): k for k in [*entries(), *also]}
    return [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)]


def resolve(name: str, quant: Optional[str] = None, also: Iterable[str] = ()) -> Resolved:
    """Resolve a short name to repos, or raise a DFlashError that suggests close names (`also` joins them)."""
    entry = find(name)
    if entry is None:
        close = suggest(name, also=also)
        hint = f"; did you mean {', '.join(close)}?" if close else "; run 'dflash-mlx models' to list them"
        raise DFlashError(f"'{name}' is not a known model name{hint}")
    if entry.architecture and not mlx_lm_supports(entry.architecture):
        import mlx_lm

        raise DFlashError(f"{entry.name}'s target is a '{entry.architecture}' model, which mlx-lm "
                          f"{mlx_lm.__version__} cannot load; upgrade mlx-lm (pip install -U mlx-lm) to use it")
    quant = quant or entry.default_quant
    if quant not in entry.targets:
        raise DFlashError(f"{entry.name} has no '{quant}' conversion; choose --quant from {', '.join(entry.targets)}")
    return Resolved(entry.name, entry.targets[quant], entry.drafter, quant, entry.thinking)


def looks_like_short_name(model: str) -> bool:
    """A registry name has no slash and is not an existing path."""
    return "/" not in model and "\\" not in model and not model.startswith((".", "~"))
