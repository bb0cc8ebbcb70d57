"""Sampling settings for DFlash: mlx-lm's sampler and logits processors, applied alike to target and drafter.

The distribution a token is drawn from is exactly the one mlx-lm's `make_sampler` draws from:
logits -> logits processors (they see the tokens before this position) -> log-softmax -> top-p, min-p, top-k
(mlx-lm's own `apply_*` functions, on the untempered log-probs, in its order) -> divide by the temperature.
This module is distribution math only; the acceptance rules built on it live in `acceptance.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import DFlashError

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


MAX_SEED = 2**64 - 1  # MLX takes seeds as unsigned 64-bit integers


def check_seed(seed, what: str = "--seed") -> None:
    """One clear error for a seed MLX cannot take (instead of its pybind message or an overflow later)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise DFlashError(f"{what} must be an integer from 0 to 2**64-1, got {seed!r}")


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's `make_sampler` options (same names, same meaning, same "off" values).

    Args:
        temp: temperature; 0 means greedy.
        top_p: nucleus mass; active when 0 < top_p < 1.
        top_k: keep the k most likely tokens; active when > 0 (k >= vocab size keeps all).
        min_p: drop tokens below min_p times the top probability; active when > 0.
        min_tokens_to_keep: tokens min-p always keeps.
    """

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def filters(self) -> bool:
        """Whether any of top-p, min-p, top-k is on (they act on normalized log-probs)."""
        return 0 < self.top_p < 1 or self.min_p != 0 or self.top_k > 0

    def __post_init__(self):
        if not self.temp >= 0:
            raise DFlashError(f"temperature must be >= 0, got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise DFlashError(f"top_p must be in [0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise DFlashError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise DFlashError(f"min_p must be in [0, 1], got {self.min_p}")
        if int(self.min_tokens_to_keep) != self.min_tokens_to_keep or self.min_tokens_to_keep < 1:
            raise DFlashError(f"min_tokens_to_keep must be a positive integer, got {self.min_tokens_to_keep}")


def filter_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's sampler filters on log-probs [..., V] (removed tokens become -inf), in `make_sampler`'s order."""
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0:
        logprobs = apply_min_p(logprobs, params.min_p, int(params.min_tokens_to_keep))
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, int(params.top_k))
    return logprobs


def log_distribution(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities [..., V] (float32) of the distribution mlx-lm's sampler draws from, given processed logits.

    At temperature 0 this is just the log-softmax (greedy picks its argmax; the filters never drop the top token).
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.filters:
        logits = filter_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)
    scaled = logits * (1.0 / params.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def process_rows(
    processors: Sequence[LogitsProcessor], history: mx.array, logits: mx.array, block: mx.array
) -> mx.array:
    """Run logits processors over rows [R, V] as the target sees them: row i after `history` + `block[:i]`."""
    if not processors:
        return logits
    rows = []
    for i in range(logits.shape[0]):
        tokens = mx.concatenate([history, block[:i].astype(history.dtype)]) if i else history
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)
