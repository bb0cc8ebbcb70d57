"""The oracle drafter: proposes the target's own greedy continuation, so every block is accepted in full.

It measures the ceiling of the machinery (τ == block size) and proves the loop's bookkeeping. Give it the full
reference sequence (prompt + the target's greedy output); it proposes `sequence[start+1 : start+B]`.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx


class _Position:
    """Stands in for a draft KV cache: only the number of committed tokens matters to the oracle."""

    def __init__(self):
        self.offset = 0

    @property
    def state(self):
        return []

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        return n


class OracleDrafter:
    """A drafter (`decode.proposers.dflash.Drafter`) that knows the answer."""

    def __init__(self, sequence: Sequence[int], vocab_size: int, block_size: int = 16, mask_token_id: int = 0):
        self.sequence: List[int] = [int(t) for t in sequence]
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.mask_token_id = mask_token_id

    def make_cache(self) -> List[_Position]:
        return [_Position()]

    def append_context(self, target_hidden: mx.array, cache: List[_Position]) -> None:
        cache[0].offset += target_hidden.shape[1]

    def rollback(self, cache: List[_Position], num_tokens: int) -> None:
        cache[0].trim(num_tokens)

    def __call__(self, block_ids: mx.array, cache: List[_Position]) -> mx.array:
        start, block = cache[0].offset, block_ids.shape[1]
        proposals = self.sequence[start + 1 : start + block]
        proposals += [0] * (block - 1 - len(proposals))
        # One-hot logits: argmax (and any sampler) picks exactly the proposal.
        hot = mx.array(proposals, dtype=mx.int32)[:, None] == mx.arange(self.vocab_size)[None]
        return mx.where(hot, 30.0, -30.0)[None]
