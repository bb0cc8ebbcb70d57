"""Prefix-cache entries on disk (`--prompt-cache-dir`), so a restart keeps long system prompts warm.

Entries the in-memory prefix cache evicts, and every entry it holds when the server stops, are written here; a
later prompt whose longest cached prefix is on disk (longer than anything in memory) loads it back. One file per
entry, `prefix-<sha1 of the key>-<sha256 of the file>.safetensors`, in mlx-lm's prompt-cache format
(`targets.caches`): the target's caches, then the drafter's, then the target features still waiting for the drafter
(as a one-slot `ArraysCache`), with the token key, lengths and the served pair's fingerprint in the metadata. Files
of another pair (another target or drafter, or the same one converted differently) are left alone and never loaded.

The folder has its own byte budget: beyond it the least recently used of our own files are deleted (files that
do not carry our name pattern and metadata are never touched).

Faults (`durable`): a file is written under a temporary name, flushed, named after its checksum and renamed, so a
crash at any moment leaves an old file or none, never half of one. At start a file of ours whose header is
unreadable or whose size is not what its header says is removed (one line for all of them), as are temporary
files of writers that died; before an entry is loaded its bytes are checked against the checksum in its name,
and one that fails is skipped and removed with one line. A failed write (a full disk) is one line for a whole run
of failures, and the request is served anyway; a folder that cannot be written is one line at start, and the
server reads its entries but stores nothing there. Entries of this pair written before names carried a checksum
(`prefix-<sha1 of the key>.safetensors`) are renamed to carry one when the folder is first read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
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
from .durable import DIGEST_HEX, sha256_of, stale_temporaries, unwritable_reason, verify, write_durably
from .prefix_cache import Snapshot

logger = logging.getLogger("dflash_mlx.server")

PREFIX = "prefix-"
SUFFIX = ".safetensors"
MARK = "dflash_mlx_prefix_entry"  # metadata key that says a file is one of ours
NAME = re.compile(rf"{PREFIX}([0-9a-f]{{40}})-([0-9a-f]{{{DIGEST_HEX}}}){re.escape(SUFFIX)}")
LEGACY = re.compile(rf"{PREFIX}[0-9a-f]{{40}}{re.escape(SUFFIX)}")  # the name before entries carried a checksum


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
    digest: str  # sha256 of the file's bytes (the end of its name), checked before it is loaded


class PrefixStore:
    """The folder's entries for one served pair; every call runs on the server's worker thread."""

    def __init__(self, folder: Path, pair: str, max_bytes: int):
        self.folder, self.pair, self.max_bytes = Path(folder), pair, max(0, int(max_bytes))
        self.entries: Dict[Tuple[int, ...], _Stored] = {}
        self.loads = self.writes = self.write_failures = 0
        self._last_use = 0  # ns: the last time stamp given, so every use gets a later one than the one before
        reason = unwritable_reason(self.folder)
        self.writable = reason is None
        damaged = self._scan()
        if not self.writable:
            logger.warning("--prompt-cache-dir %s cannot be written (%s): serving without storing prefixes there%s",
                           self.folder, reason, f" (its {len(self.entries)} entries are still read)"
                           if self.entries else "")
            return
        for path in damaged + stale_temporaries(self.folder, PREFIX, SUFFIX):
            _remove(path)
        if damaged:
            logger.warning("removed %d damaged prompt cache file(s) from %s (cut short or unreadable)",
                           len(damaged), self.folder)

    def _scan(self) -> List[Path]:
        """Read the folder's entries of this pair (headers only); returns our files that are damaged."""
        damaged: List[Path] = []
        if not self.folder.is_dir():
            return damaged
        for path in sorted(self.folder.glob(f"{PREFIX}*{SUFFIX}")):
            match = NAME.fullmatch(path.name)
            if match is None and LEGACY.fullmatch(path.name) and self.writable:
                path, match = self._adopt(path)
            if match is None:
                continue  # not one of ours: left alone
            meta = _metadata(path)
            if meta is None:
                damaged.append(path)
                continue
            if meta.get(MARK) != "1" or meta.get("pair") != self.pair:
                continue
            try:
                key = tuple(int(t) for t in json.loads(meta["key"]))
                stat = path.stat()
                stored = _Stored(key, path, meta["cuttable"] == "1", stat.st_size, match.group(2))
            except (KeyError, ValueError, TypeError, OSError):
                damaged.append(path)
                continue
            older = self.entries.get(key)
            if older is not None:  # a rewrite cut off before it removed the file it replaces: keep the newer
                if older.path.stat().st_mtime_ns > stat.st_mtime_ns:
                    older, stored = stored, older
                if self.writable:
                    _remove(older.path)
            self.entries[key] = stored
            self._last_use = max(self._last_use, stored.path.stat().st_mtime_ns)
        return damaged

    def _adopt(self, path: Path) -> Tuple[Path, Optional["re.Match"]]:
        """An entry of this pair written before entries carried their checksum, renamed to carry it now (its
        bytes are what they are: whole, since it was renamed into place, or cut short, which `_metadata` tells).
        Anything else under the old name is left alone."""
        meta = _metadata(path)
        if meta is None or meta.get(MARK) != "1" or meta.get("pair") != self.pair:
            return path, None
        try:
            named = path.with_name(f"{path.name[: -len(SUFFIX)]}-{sha256_of(path)}{SUFFIX}")
            os.replace(path, named)
        except OSError:
            return path, None
        return named, NAME.fullmatch(named.name)

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
        """The entry as a snapshot, or None (one warning; the file removed) when its bytes no longer match their
        checksum or it cannot be read: a damaged file must not fail the request that found it."""
        if not verify(stored.path, stored.digest):
            self._discard(stored, "its checksum does not match: damaged or cut short")
            return None
        try:
            caches, meta = load_prompt_cache(str(stored.path), return_metadata=True)
            n_target, n_draft = int(meta["targets"]), int(meta["drafts"])
            target = caches[:n_target]
            draft = caches[n_target: n_target + n_draft] if n_draft >= 0 else None
            pending = caches[-1].cache[0] if meta["pending"] == "1" else None
            snapshot = Snapshot(target, draft, pending, int(meta["length"]), int(meta["nbytes"]), stored.cuttable)
        except Exception as e:
            self._discard(stored, f"it could not be read ({e})")
            return None
        self._touch(stored.path)  # recently used: the last to be dropped when the folder is over its budget
        self.loads += 1
        return snapshot

    def _discard(self, stored: _Stored, why: str) -> None:
        logger.warning("prompt cache file %s skipped and removed: %s", stored.path, why)
        self.entries.pop(stored.key, None)
        if self.writable:
            _remove(stored.path)

    # -- writing -------------------------------------------------------------------------------------------------
    def save(self, key: Sequence[int], snapshot: Snapshot) -> None:
        """Write (or rewrite) the entry for `key`; a failed write is a warning, never a failed request."""
        key = tuple(int(t) for t in key)
        if not self.writable or not key or snapshot.nbytes > self.max_bytes:
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
        named = hashlib.sha1(json.dumps(list(key)).encode()).hexdigest()
        try:
            path = write_durably(self.folder, PREFIX, SUFFIX, lambda tmp: save_prompt_cache(str(tmp), caches, meta),
                                 lambda digest: f"{PREFIX}{named}-{digest}{SUFFIX}")
            self._touch(path)
            size = path.stat().st_size
        except Exception as e:  # a full disk, a folder gone read-only, an I/O error: the request is served anyway
            self._write_failed(e)
            return
        if self.write_failures:
            logger.warning("--prompt-cache-dir %s takes writes again (%d failed before)", self.folder,
                           self.write_failures)
            self.write_failures = 0
        older = self.entries.get(key)
        if older is not None and older.path != path:
            _remove(older.path)
        self.entries[key] = _Stored(key, path, snapshot.cuttable, size, NAME.fullmatch(path.name).group(2))
        self.writes += 1
        self._keep_budget(keep=key)

    def _write_failed(self, error: BaseException) -> None:
        """One line for the first failed write of a run of them (a full disk fails every write until freed)."""
        self.write_failures += 1
        if self.write_failures == 1:
            logger.warning("could not write a prompt cache entry to %s (%s); requests are still served, and "
                           "further failures are not logged until a write succeeds", self.folder, error)

    def _touch(self, path: Path) -> None:
        """Stamp `path` as used now, strictly after the previous use. The kernel's own "now" (a plain utime or a
        write) is coarse (a clock tick), so two uses in one tick would tie and the least recently used order
        would be lost; explicit stamps keep it, also across restarts (the order is read back from mtimes)."""
        now = max(time.time_ns(), self._last_use + 1)
        self._last_use = now
        if self.writable:
            try:
                os.utime(path, ns=(now, now))
            except OSError:  # the order is a hint: a folder that stopped taking writes still serves reads
                pass

    def _keep_budget(self, keep: Tuple[int, ...]) -> None:
        """Delete our least recently used files while the folder's entries exceed the budget."""
        if not self.writable:
            return
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
            _remove(stored.path)
            self.entries.pop(stored.key, None)
            total -= stored.nbytes


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # gone read-only meanwhile: the file stays, and is skipped again next time
        pass


def _metadata(path: Path) -> Optional[Dict[str, str]]:
    """A prompt-cache file's own metadata, read from its header alone: None if it is not a whole safetensors file
    (an unreadable header, or a size other than the header's tensors need: cut short or grown)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < (64 << 20):
                return None
            header = json.loads(f.read(size))
            total = os.fstat(f.fileno()).st_size
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if total != 8 + size + max(ends, default=0):
        return None
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        return None
    # mlx-lm's prompt-cache files flatten [metadata, cache classes, scalars]: ours is the first.
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def prepare_folder(folder: str) -> Path:
    """`folder` as a path, or one clear error when it names a file (before any model is loaded). A folder that
    cannot be created or written is no error: the store says so in one line and the server runs without it."""
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise DFlashError(f"--prompt-cache-dir {folder}: this is a file; give a folder (it is created if missing)")
    return path
