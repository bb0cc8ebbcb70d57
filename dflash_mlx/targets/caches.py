"""mlx-lm's cache protocol over every cache a target or drafter uses: ours (`WindowKVCache`, `GatedDeltaCache`)
and mlx-lm's own (`KVCache`, ...).

- `can_trim(cache)`: whether the cache can be cut back to any shorter length, so one copy of it serves every
  prefix of its tokens. mlx-lm's `is_trimmable()` cannot answer that for us: our caches answer True because they
  can drop the tokens of their newest write (what speculative rollback needs), not any number of tokens; and a
  `RotatingKVCache`'s answer turns False once its window fills, so one taken on a fresh cache would not last.
- `copy_cache(cache)`: an independent copy (the class's `copy()` where it has one, else `from_state(state)` with
  fresh array objects, since MLX's in-place stores write into the array object they are given).
- `save_prompt_cache` / `load_prompt_cache`: mlx-lm's file format, unchanged. Saving is mlx-lm's own function
  (it needs only `state` and the class name), plus each layer's `meta_state` in the file's metadata under
  `META_STATE_KEY`. mlx-lm's loader looks class names up in its own module's globals, so it cannot rebuild our
  classes, and we do not patch that module; our loader reads the same format and looks the names up among our
  classes first, then mlx-lm's. Files without our classes load the same with either loader.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .hybrid import GatedDeltaCache
from .rotating import WindowKVCache

# Ours, by the class name a saved file records.
CACHE_CLASSES = {cls.__name__: cls for cls in (WindowKVCache, GatedDeltaCache)}
META_STATE_KEY = "dflash_mlx_meta_state"
# mlx-lm caches whose `trim(n)` works for every n up to their length, whatever they hold. Exact types: a subclass
# may trim differently.
_CUT_ANYWHERE = (KVCache, QuantizedKVCache)


def can_trim(cache: Any) -> bool:
    """Whether `cache` can be cut back to any shorter length (see the module docstring)."""
    return type(cache) in _CUT_ANYWHERE and cache.is_trimmable()


def _fresh(x: Any) -> Any:
    return x[...] if isinstance(x, mx.array) else x


def copy_cache(cache: Any) -> Any:
    """A cache equal to `cache` that later writes or trims to either one leave the other as it was."""
    own = getattr(cache, "copy", None)
    if own is not None:
        return own()
    return type(cache).from_state(tree_map(_fresh, cache.state))


def save_prompt_cache(file_name: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None) -> None:
    """mlx-lm's `save_prompt_cache`, for caches of our classes too."""
    metadata = dict(metadata or {})
    metas = [list(getattr(c, "meta_state", None) or ()) for c in cache]
    if any(metas):
        metadata[META_STATE_KEY] = json.dumps(metas)
    mlx_cache.save_prompt_cache(file_name, cache, metadata)


def _cache_class(name: str):
    cls = CACHE_CLASSES.get(name) or getattr(mlx_cache, name, None)
    if cls is None or not hasattr(cls, "from_state"):
        raise ValueError(f"unknown cache class {name!r} in saved prompt cache")
    return cls


def load_prompt_cache(file_name: str, return_metadata: bool = False
                      ) -> Union[List[Any], Tuple[List[Any], Dict[str, str]]]:
    """mlx-lm's `load_prompt_cache`, for files that hold our cache classes too."""
    arrays, raw = mx.load(file_name, return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(raw.items()))
    # Scalars were stored as arrays: decode them as mlx-lm's loader does.
    for pos, kind in scalars[1:]:
        if kind == "scalar":
            arrays[pos] = arrays[pos].item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in arrays[pos].tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"unknown scalar type {kind!r} in saved prompt cache")
    states = tree_unflatten(list(arrays.items()))
    metas = json.loads(metadata.pop(META_STATE_KEY, "null")) or [[] for _ in classes]
    cache = []
    for name, state, meta in zip(classes, states, metas):
        cls = _cache_class(name)
        cache.append(cls.from_state(state, meta) if meta else cls.from_state(state))
    return (cache, metadata) if return_metadata else cache
