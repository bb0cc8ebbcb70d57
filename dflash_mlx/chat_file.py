"""A conversation saved by `dflash-mlx chat`'s /save, read back field by field, and the sampling values a chat
accepts (from a saved file or a /temp command): each wrong value is one line saying which and why.
"""

from __future__ import annotations

import math
from typing import Dict

from .errors import DFlashError

_ROLES = ("system", "user", "assistant")
# stream_generate's numeric sampling options (a saved file is passed back to it as keywords)
_SAMPLING_KEYS = ("temp", "top_p", "top_k", "min_p", "min_tokens_to_keep", "seed", "repetition_penalty",
                  "repetition_context_size")


def check_sampling(sampling: Dict) -> None:
    """Raise a one-line DFlashError for a sampling value `stream_generate` would refuse (or that would make every
    reply fail or be meaningless): numbers only, finite, in range."""
    from .decode.sampling import SamplingParams, check_seed

    for key, value in sampling.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DFlashError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise DFlashError(f"{key} must be a finite number, got {value}")
    params = {k: v for k, v in sampling.items() if k in ("temp", "top_p", "top_k", "min_p", "min_tokens_to_keep")
              and v is not None}
    SamplingParams(**params)
    check_seed(sampling.get("seed"), "seed")
    penalty = sampling.get("repetition_penalty")
    if penalty is not None and not penalty > 0:
        raise DFlashError(f"repetition_penalty must be > 0, got {penalty}")
    size = sampling.get("repetition_context_size")
    if size is not None and (int(size) != size or size < 1):
        raise DFlashError(f"repetition_context_size must be a positive integer, got {size}")


def parse_conversation(data, path: str):
    """(system, messages, sampling, thinking) of a saved conversation, checked field by field."""
    def bad(what: str) -> DFlashError:
        return DFlashError(f"{path} is not a conversation saved with /save: {what}")

    if not isinstance(data, dict):
        raise bad("the top level must be a JSON object")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise bad("'messages' must be a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise bad(f"message {i} must be an object with a role ({', '.join(_ROLES)}) and a text content")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("'system' must be a string or null")
    sampling = data.get("sampling")
    if sampling is not None:
        if not isinstance(sampling, dict) or set(sampling) - set(_SAMPLING_KEYS):
            raise bad(f"'sampling' may hold only {', '.join(_SAMPLING_KEYS)}")
        try:
            check_sampling(sampling)
        except DFlashError as e:
            raise bad(f"'sampling' is invalid ({e})") from None
    thinking = data.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("'thinking' must be true, false or null")
    return system, [dict(role=m["role"], content=m["content"]) for m in messages], sampling, thinking
