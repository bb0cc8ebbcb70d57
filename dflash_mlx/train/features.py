"""The feature cache: the frozen target runs once over the data; training reads its tapped features from disk.

Layout of a cache directory:

    meta.json        shapes, the target and taps the features came from, the data summary
    tokens.npy       [N, S] int32 token rows          trainable.npy  [N, S] uint8 label mask
    eval.json        held-out prompts (token ids) for τ
    features.f16     [N, S, n*H] float16, memory-mapped (tapped layer outputs, concatenated as the drafter reads them)
    argmax.i32       [N, S] int32: the target's greedy next token after each position (`--labels target`)
    topk_ids.i32     [N, S, k] int32  \\  the target's top-k next-token log-probs at each position
    topk_logp.f16    [N, S, k] float16 /  (k = 0: not stored)
    progress.json    {"rows_done": n}: rows [0, n) are final; extraction resumes at row n

Rows are written in order and `progress.json` is replaced atomically after their data is flushed, so an
interrupted extraction continues where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from .data import PreparedData

FP16_MAX = 65504.0


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _meta_int(key: str) -> property:
    """A shape fact read from meta.json, as an int."""
    return property(lambda self: int(self.meta[key]))


class FeatureCache:
    def __init__(self, path: Path, meta: Dict):
        self.path = Path(path)
        self.meta = meta
        self.tokens: np.ndarray = np.load(self.path / "tokens.npy", mmap_mode="r")
        self.trainable: np.ndarray = np.load(self.path / "trainable.npy", mmap_mode="r")
        self.eval_prompts: List[List[int]] = json.loads((self.path / "eval.json").read_text())

    # -- shape facts -----------------------------------------------------------------------------------------
    rows = _meta_int("rows")
    seq_len = _meta_int("seq_len")
    feature_dim = _meta_int("feature_dim")
    topk = _meta_int("topk")

    @property
    def rows_done(self) -> int:
        file = self.path / "progress.json"
        return int(json.loads(file.read_text())["rows_done"]) if file.is_file() else 0

    @property
    def complete(self) -> bool:
        return self.rows_done >= self.rows

    def _memmap(self, name: str, dtype, last: int, mode: str = "r") -> np.memmap:
        return np.memmap(self.path / name, dtype=dtype, mode=mode, shape=(self.rows, self.seq_len, last))

    def features(self, mode: str = "r") -> np.memmap:
        return self._memmap("features.f16", np.float16, self.feature_dim, mode)

    def argmax(self, mode: str = "r") -> Optional[np.memmap]:
        """[N, S] the target's argmax at each position (it predicts the token at the next position), or None for a
        cache written before it was stored."""
        if int(self.meta.get("format", 1)) < 2:
            return None
        return np.memmap(self.path / "argmax.i32", dtype=np.int32, mode=mode, shape=(self.rows, self.seq_len))

    def teacher(self, mode: str = "r"):
        """(ids, logp) memmaps of the target's top-k, or None if not stored."""
        if not self.topk:
            return None
        return (self._memmap("topk_ids.i32", np.int32, self.topk, mode),
                self._memmap("topk_logp.f16", np.float16, self.topk, mode))

    # -- creating and opening ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, path, data: PreparedData, *, feature_dim: int, topk: int, fingerprint: Dict) -> "FeatureCache":
        """Write the token rows and allocate (sparse) feature files; features are filled by `extract`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        rows, seq_len = data.tokens.shape
        np.save(path / "tokens.npy", data.tokens.astype(np.int32))
        np.save(path / "trainable.npy", data.trainable.astype(np.uint8))
        _write_json(path / "eval.json", data.eval_prompts)
        meta = dict(rows=int(rows), seq_len=int(seq_len), feature_dim=int(feature_dim), topk=int(topk),
                    fingerprint=fingerprint, data=data.summary, format=2)
        cache = cls(path, meta)
        cache.features("w+").flush()
        cache.argmax("w+").flush()
        if topk:
            for m in cache.teacher("w+"):
                m.flush()
        _write_json(path / "progress.json", {"rows_done": 0})
        _write_json(path / "meta.json", meta)  # last: its presence means the cache is set up
        return cache

    @classmethod
    def open(cls, path, fingerprint: Optional[Dict] = None) -> Optional["FeatureCache"]:
        """The cache at `path`, or None if there is none; refuses one extracted from another target or taps."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            return None
        meta = json.loads((path / "meta.json").read_text())
        if fingerprint is not None:
            theirs = meta.get("fingerprint", {})
            diff = sorted(k for k in set(fingerprint) | set(theirs) if fingerprint.get(k) != theirs.get(k))
            if diff:
                raise DFlashError(
                    f"feature cache '{path}' was built with other settings ({', '.join(diff)}: "
                    f"{[theirs.get(k) for k in diff]} vs {[fingerprint.get(k) for k in diff]}); "
                    "pass another --cache or delete it"
                )
        return cls(path, meta)

    # -- extraction ------------------------------------------------------------------------------------------------
    def extract(self, target, *, batch_rows: int = 1, progress: bool = True, stop_after: Optional[int] = None) -> Dict:
        """Run `target` (a `TargetModel` tapping the drafter's layers) over the rows not yet extracted.

        `stop_after` ends after that many rows (tests use it to interrupt). Returns {"rows", "tokens", "seconds"}.
        """
        from tqdm import tqdm

        start = self.rows_done
        end = self.rows if stop_after is None else min(self.rows, start + stop_after)
        feats = self.features("r+")
        greedy = self.argmax("r+")
        teacher = self.teacher("r+")
        S, k = self.seq_len, self.topk
        tic = time.perf_counter()
        with tqdm(total=self.rows * S, initial=start * S, desc="target features", unit="tok", unit_scale=True,
                  disable=not progress) as bar:
            for row in range(start, end, batch_rows):
                stop = min(row + batch_rows, end)
                ids = mx.array(np.asarray(self.tokens[row:stop]))
                logits, hidden = target(ids)
                if hidden.shape[-1] != self.feature_dim:
                    raise DFlashError(f"target features have width {hidden.shape[-1]}, the cache expects "
                                      f"{self.feature_dim}; pass another --cache")
                hidden = mx.clip(hidden, -FP16_MAX, FP16_MAX).astype(mx.float16)
                out = [hidden, mx.argmax(logits, axis=-1).astype(mx.int32)]
                if k:
                    logits = logits.astype(mx.float32)
                    top = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
                    logp = mx.take_along_axis(logits, top, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
                    out += [top.astype(mx.int32), logp.astype(mx.float16)]
                mx.eval(out)
                feats[row:stop] = np.asarray(out[0])
                if greedy is not None:  # a cache begun by an older version has no argmax file
                    greedy[row:stop] = np.asarray(out[1])
                    greedy.flush()
                if k:
                    teacher[0][row:stop] = np.asarray(out[2])
                    teacher[1][row:stop] = np.asarray(out[3])
                    teacher[0].flush()
                    teacher[1].flush()
                feats.flush()
                _write_json(self.path / "progress.json", {"rows_done": stop})
                bar.update((stop - row) * S)
        seconds = time.perf_counter() - tic
        return {"rows": end - start, "tokens": (end - start) * S, "seconds": seconds}
