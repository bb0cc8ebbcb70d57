"""One lock per tokenizer, held by every thread that uses it.

The HTTP handlers (the event loop thread) render and encode prompts and decode log-probability tokens while the
worker thread detokenizes the running reply, all on one Hugging Face tokenizer. That object is not safe to share
between threads: each `encode` first sets the Rust backend's truncation, padding and special-token switches for
its own call (a mutable borrow that fails with "Already borrowed" while another thread is inside a call, or
leaves the other call with the wrong settings). Each request does get its own streaming detokenizer (mlx-lm's
`TokenizerWrapper.detokenizer` hands out a copy), but the naive detokenizer decodes through the shared tokenizer.
"""

from __future__ import annotations

import threading
import weakref

_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def tokenizer_lock(tokenizer) -> threading.RLock:
    """The lock of the Hugging Face tokenizer behind `tokenizer` (an mlx-lm `TokenizerWrapper` or the tokenizer)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    inner = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    with _guard:
        lock = _locks.get(inner)
        if lock is None:
            lock = _locks[inner] = threading.RLock()
        return lock
