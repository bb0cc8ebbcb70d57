"""Prefix-cache entries on disk (`--prompt-cache-dir`), so a restart keeps long system prompts warm.

Entries the in-memory prefix cache evicts, and every entry it holds when the server stops, are written here; a
later prompt whose longest cached prefix is on disk (longer than anything in memory) loads it back. One file per
entry, `prefix-<sha1 of the key>.safetensors`, in mlx-lm's prompt-cache format (`targets.caches`): the target's
caches, then the drafter's, then the target features still waiting for the drafter (as a one-slot `ArraysCache`),
with the token key, lengths and the served pair's fingerprint in the metadata. Files of another pair (another
target or drafter, or the same one converted differently) are left alone and never loaded.

The folder has its own byte budget: beyond it the least recently used of our own files are deleted (files that
do not carry our name pattern and metadata are never touched). Files are written through a temporary name and
renamed, so a crash leaves an old file or none, never half of one; an unreadable file is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from ..errors import DFlashError
from ..targets.caches import load_prompt_cache, save_prompt_cache
from .prefix_cache import Snapshot

logger = logging.getLogger("dflash_mlx.server")

PREFIX = "prefix-"
SUFFIX = ".safetensors"
MARK = "dflash_mlx_prefix_entry"  # metadata key that says a file is one of ours


def fingerprint(*modules: Any) -> str:
    """A short digest of the served pair: parameter names, shapes, dtypes and a sample of each tensor's values.
    Two pairs that differ in any weight file almost surely differ here; reading it costs a few KB per tensor."""
    h = hashlib.sha1()
    for module in modules:
        if module is None:
            h.update(b"none")
            continue
        for name, value in sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0]):
            h.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
            h.update(np.array(value.reshape(-1)[:256].astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


@dataclass
class _Stored:
    key: Tuple[int, ...]
    path: Path
    cuttable: bool
    nbytes: int


class PrefixStore:
    """The folder's entries for one served pair; every call runs on the server's worker thread."""

    def __init__(self, folder: Path, pair: str, max_bytes: int):
        self.folder, self.pair, self.max_bytes = Path(folder), pair, max(0, int(max_bytes))
        self.entries: Dict[Tuple[int, ...], _Stored] = {}
        self.loads = self.writes = 0
        self._last_use = 0  # ns: the last time stamp given, so every use gets a later one than the one before
        for path in sorted(self.folder.glob(f"{PREFIX}*{SUFFIX}")):
            meta = _metadata(path)
            if meta is None or meta.get(MARK) != "1" or meta.get("pair") != self.pair:
                continue
            key = tuple(json.loads(meta["key"]))
            stat = path.stat()
            self.entries[key] = _Stored(key, path, meta["cuttable"] == "1", stat.st_size)
            self._last_use = max(self._last_use, stat.st_mtime_ns)

    # -- reading -------------------------------------------------------------------------------------------------
    def best(self, tokens: Sequence[int], limit: int) -> Tuple[int, Optional[_Stored]]:
        """(tokens it covers, entry) for the stored entry covering most of `tokens[:limit]` (0, None: none)."""
        tokens = list(tokens[:limit])
        best: Tuple[int, Optional[_Stored]] = (0, None)
        for key, stored in self.entries.items():
            if stored.cuttable:
                n = 0
                while n < min(len(key), len(tokens)) and key[n] == tokens[n]:
                    n += 1
            else:  # a recurrent or windowed cache serves only prompts that extend its whole key
                n = len(key) if len(key) <= len(tokens) and tuple(tokens[: len(key)]) == key else 0
            if n > best[0]:
                best = (n, stored)
        return best

    def load(self, stored: _Stored) -> Optional[Snapshot]:
        """The entry as a snapshot, or None (with a warning) when its file cannot be read any more."""
        try:
            caches, meta = load_prompt_cache(str(stored.path), return_metadata=True)
            n_target, n_draft = int(meta["targets"]), int(meta["drafts"])
            target = caches[:n_target]
            draft = caches[n_target: n_target + n_draft] if n_draft >= 0 else None
            pending = caches[-1].cache[0] if meta["pending"] == "1" else None
            snapshot = Snapshot(target, draft, pending, int(meta["length"]), int(meta["nbytes"]), stored.cuttable)
        except Exception as e:  # a damaged or foreign file must not fail the request that found it
            logger.warning("prompt cache file %s could not be read (%s); skipping it", stored.path, e)
            self.entries.pop(stored.key, None)
            return None
        self._touch(stored.path)  # recently used: the last to be dropped when the folder is over its budget
        self.loads += 1
        return snapshot

    # -- writing -------------------------------------------------------------------------------------------------
    def save(self, key: Sequence[int], snapshot: Snapshot) -> None:
        """Write (or rewrite) the entry for `key`; a failed write is a warning, never a failed request."""
        key = tuple(int(t) for t in key)
        if not key or snapshot.nbytes > self.max_bytes:
            return
        caches: List[Any] = list(snapshot.target) + list(snapshot.draft or [])
        if snapshot.pending is not None:
            waiting = ArraysCache(size=1)
            waiting.cache = [snapshot.pending]
            caches.append(waiting)
        meta = {MARK: "1", "pair": self.pair, "key": json.dumps(list(key)), "length": str(snapshot.length),
                "targets": str(len(snapshot.target)), "drafts": str(-1 if snapshot.draft is None else len(snapshot.draft)),
                "pending": "1" if snapshot.pending is not None else "0", "nbytes": str(snapshot.nbytes),
                "cuttable": "1" if snapshot.cuttable else "0"}
        path = self.folder / f"{PREFIX}{hashlib.sha1(json.dumps(list(key)).encode()).hexdigest()}{SUFFIX}"
        tmp = self.folder / f".{PREFIX}{secrets.token_hex(6)}.tmp{SUFFIX}"
        try:
            save_prompt_cache(str(tmp), caches, meta)
            os.replace(tmp, path)
            self._touch(path)
        except Exception as e:
            tmp.unlink(missing_ok=True)
            logger.warning("could not write the prompt cache entry to %s (%s)", self.folder, e)
            return
        self.entries[key] = _Stored(key, path, snapshot.cuttable, path.stat().st_size)
        self.writes += 1
        self._keep_budget(keep=key)

    def _touch(self, path: Path) -> None:
        """Stamp `path` as used now, strictly after the previous use. The kernel's own "now" (a plain utime or a
        write) is coarse (a clock tick), so two uses in one tick would tie and the least recently used order
        would be lost; explicit stamps keep it, also across restarts (the order is read back from mtimes)."""
        now = max(time.time_ns(), self._last_use + 1)
        self._last_use = now
        os.utime(path, ns=(now, now))

    def _keep_budget(self, keep: Tuple[int, ...]) -> None:
        """Delete our least recently used files while the folder's entries exceed the budget."""
        def used(stored: _Stored) -> int:
            try:
                return stored.path.stat().st_mtime_ns
            except OSError:
                return 0

        total = sum(s.nbytes for s in self.entries.values())
        for stored in sorted(self.entries.values(), key=used):
            if total <= self.max_bytes:
                break
            if stored.key == keep:
                continue
            stored.path.unlink(missing_ok=True)
            self.entries.pop(stored.key, None)
            total -= stored.nbytes


def _metadata(path: Path) -> Optional[Dict[str, str]]:
    """A prompt-cache file's own metadata, read from its header alone (None if it is not a safetensors file)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < (64 << 20):
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return None
    # mlx-lm's prompt-cache files flatten [metadata, cache classes, scalars]: ours is the first.
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def prepare_folder(folder: str) -> Path:
    """`folder` created if missing and checked writable, or one clear error (before any model is loaded)."""
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise DFlashError(f"--prompt-cache-dir {folder}: this is a file; give a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".{PREFIX}{secrets.token_hex(4)}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DFlashError(f"--prompt-cache-dir {folder}: cannot write there ({e.strerror or e}); give a folder "
                          "this user can write") from None
    return path
