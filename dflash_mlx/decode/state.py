"""What one generation carries between verify passes, and the prefill that fills it.

`DecodeState` holds the target's and the drafter's caches, the last committed token (the next block's slot 0,
not yet in the target cache) and the tapped features of committed tokens not yet in the draft cache; a chat
carries it from turn to turn and the server's prefix cache snapshots it. `prefill` runs a prompt through the
target in chunks, feeding each chunk's features to the draft cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..targets import TargetModel


@dataclass
class DecodeState:
    """The caches and the carry-over between passes; see the module docstring."""

    target_cache: List[Any]
    draft_cache: Optional[List[Any]]
    last_token: int = -1
    pending_context: Optional[mx.array] = None  # [1, S, n*H] tapped features not yet in the draft cache
    extra: dict = field(default_factory=dict)

    @classmethod
    def fresh(cls, target: TargetModel, drafter=None) -> "DecodeState":
        """Empty caches for this target and drafter (no draft cache without a drafter)."""
        return cls(target.make_cache(), drafter.make_cache() if drafter is not None else None)

    def add_context(self, features: Optional[mx.array]) -> None:
        """Features of newly committed tokens: they wait for the next draft (None: nothing to add)."""
        if features is not None:
            self.pending_context = (features if self.pending_context is None
                                    else mx.concatenate([self.pending_context, features], axis=1))

    def drop_context(self, n: int) -> None:
        """Take the newest `n` waiting features back out (a committed pass undone)."""
        if self.pending_context is not None:
            waiting = self.pending_context
            self.pending_context = waiting[:, :-n] if waiting.shape[1] > n else None

    def flush_context(self, drafter) -> Optional[mx.array]:
        """Hand the waiting features to the draft cache; returns them (None if there were none)."""
        context, self.pending_context = self.pending_context, None
        if context is not None and drafter is not None:
            drafter.append_context(context, self.draft_cache)
        return context


def prefill_alone(target: TargetModel, drafter, prompt: mx.array, state: DecodeState, step_size: int = 2048,
                  progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
    """`prefill` for a caller that runs no pass step over it (a server's prefix cache, a benchmark's untimed
    prompt): a drafter that pairs each hidden row with the token after it (MTP layers) is told the prompt's tokens
    first, as the pass step's proposers are (`step.Decoder.start`)."""
    add_tokens = getattr(drafter, "add_tokens", None)
    if add_tokens is not None:
        add_tokens(state.draft_cache, prompt.tolist())
    return prefill(target, drafter, prompt, state, step_size, progress)


def prefill(target: TargetModel, drafter, prompt: mx.array, state: DecodeState, step_size: int = 2048,
            progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
    """Run the prompt through the target in chunks, feeding each chunk's features to the drafter's cache.

    With a `state` from an earlier generation (a later chat turn), the prompt continues it: the last committed
    token and the features still waiting for the draft cache go in first. Returns the last position's logits [V].
    `progress(done, total)`, if given, is called after each chunk with the prompt tokens processed so far.
    """
    if state.last_token >= 0:
        prompt = mx.concatenate([mx.array([state.last_token], dtype=prompt.dtype), prompt])
    logits = None
    with mx.stream(generation_stream):
        state.flush_context(drafter)
        for begin in range(0, prompt.shape[0], step_size):
            if begin:
                mx.clear_cache()  # a long prompt's activations are not needed again
            chunk = prompt[begin : begin + step_size][None]
            logits, hidden = target(chunk, state.target_cache)
            if drafter is not None:
                drafter.append_context(hidden, state.draft_cache)
            mx.eval(logits[:, -1], [c.state for c in state.target_cache],
                    [c.state for c in state.draft_cache] if state.draft_cache else [])
            if progress is not None:
                progress(min(begin + step_size, prompt.shape[0]), prompt.shape[0])
    return logits[0, -1]
