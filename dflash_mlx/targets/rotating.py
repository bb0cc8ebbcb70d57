"""A sliding-window KV cache whose newest tokens can be dropped, for gpt-oss, Gemma and other windowed targets.

mlx-lm's `RotatingKVCache` writes single tokens into a ring, so once the window is full a token that is later
rejected has already overwritten the oldest one still needed; its `trim` is refused then. `WindowKVCache` keeps
its buffer in temporal order instead: the `max_size - 1` tokens before the newest write, then that whole write.
That is exactly what the write's queries attend to, so (a) any suffix of the newest write can be dropped and the
next write still sees a full window, and (b) mlx-lm's own `make_mask` (inherited) stays exact, for verify blocks
and single-token steps alike. The price is one copy of the window per write instead of an in-place ring store.

It keeps mlx-lm's cache protocol: `state` is mlx-lm's `RotatingKVCache` tuple (keys, values, offset, keep,
max_size, idx) holding exactly the live rows (`trim` only moves `_idx`, so rows it dropped stay in the buffer until
the next write; `state` leaves them out), `meta_state` the scalars as strings (the older mlx-lm convention),
`from_state`, `copy`, `nbytes` (the buffer, dropped rows included: that is the memory held). Saving and loading
go through `dflash_mlx.targets.caches`, since mlx-lm's loader only knows its own class names.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from ..errors import DFlashError


class WindowKVCache(RotatingKVCache):
    """`RotatingKVCache` kept in temporal order: `_idx` valid entries, the last of them the newest write."""

    def __init__(self, max_size: int, keep: int = 0):
        if keep:
            raise ValueError("WindowKVCache does not support keep > 0 (mlx-lm's sliding-window models use keep=0)")
        super().__init__(max_size=max_size, keep=0)

    @classmethod
    def like(cls, cache: RotatingKVCache) -> "WindowKVCache":
        if cache.keys is not None:
            raise ValueError("only an empty RotatingKVCache can be converted")
        return cls(cache.max_size, cache.keep)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, n_kv_heads, S, head_dim]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            start = max(self._idx - (self.max_size - 1), 0)
            self.keys = mx.concatenate([self.keys[..., start : self._idx, :], keys], axis=2)
            self.values = mx.concatenate([self.values[..., start : self._idx, :], values], axis=2)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def keys_and_values(self):
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    @property
    def state(self):
        keys, values = self.keys, self.values
        if keys is not None and self._idx < keys.shape[2]:  # rows a trim dropped: leave them out
            keys, values = self.keys_and_values()
        return keys, values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        keys, values, offset, keep, max_size, idx = v
        if keep:
            raise ValueError("WindowKVCache does not support keep > 0")
        if keys is not None and keys.shape[2] != idx:
            raise ValueError(f"WindowKVCache state holds {keys.shape[2]} rows but says {idx} are live")
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @property
    def meta_state(self):
        return tuple(str(x) for x in (self.keep, self.max_size, self.offset, self._idx))

    @meta_state.setter
    def meta_state(self, v):
        self.keep, self.max_size, self.offset, self._idx = (int(x) for x in v)

    @classmethod
    def from_state(cls, state, meta_state: Optional[Sequence[str]] = None) -> "WindowKVCache":
        obj = cls.__new__(cls)
        obj.state = state
        if meta_state:
            obj.meta_state = meta_state
        return obj

    def copy(self) -> "WindowKVCache":
        """An independent cache: new array objects over the live rows (an in-place store into an array object
        would reach every holder of that object)."""
        keys, values, *scalars = self.state
        if keys is not None:
            keys, values = keys[...], values[...]
        return type(self).from_state((keys, values, *scalars))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        # The next write attends to min(offset, max_size - 1) earlier tokens; they must still be here.
        if self._idx - n < min(self.offset - n, self.max_size - 1):
            raise DFlashError(f"WindowKVCache can only drop tokens of its newest write; cannot trim {n}")
        self.offset -= n
        self._idx -= n
        return n
