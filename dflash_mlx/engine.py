"""The DFlash decoding loop: prefill, then draft a block, verify it in one target pass, keep the matching prefix.

`dflash_generate_step` yields one `Cycle` per verify pass (the first one is the prefill's token). Every committed
token is the target's own greedy choice given the committed prefix, so the output equals plain greedy decoding;
with a sampling acceptor (`acceptance.py`) it is distributed exactly as sampling the target alone.
Loop and bookkeeping: dflash-reference.md section 3.

Host/device overlap: each cycle's whole graph (draft, verify, acceptance) is queued with `mx.async_eval`, and the
only host sync is one `.tolist()` of the packed acceptance result. The next cycle is queued before the current
one's tokens are handed to the caller, so detokenizing and printing overlap the device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator, List, Optional, Sequence

import mlx.core as mx

from .acceptance import GreedyAcceptor
from .target import TargetModel


@dataclass
class Cycle:
    """Tokens committed by one verify pass."""

    tokens: List[int]
    accepted: int  # draft tokens accepted (0..block-1); the last token is always the target's bonus
    block_size: int  # tokens verified in this pass (1 for the prefill cycle)
    logits: Optional[mx.array] = None  # [len(tokens), V] target logits that chose each token (lazy)
    is_prefill: bool = False


@dataclass
class _Pending:
    """A queued cycle: the device is computing it while the host yields the previous one."""

    block: int
    packed: mx.array  # [acc, choice_0..choice_{b-1}, draft_1..draft_{b-1}]
    logits: mx.array
    hidden: mx.array
    context: Optional[mx.array]  # features this cycle appended to the draft cache (restored if abandoned)


@dataclass
class DecodeState:
    """Everything the loop carries between cycles; rolled back if the caller stops mid-generation."""

    target_cache: List[Any]
    draft_cache: Optional[List[Any]]
    last_token: int = -1
    pending_context: Optional[mx.array] = None  # tapped features not yet in the draft cache
    extra: dict = field(default_factory=dict)


def _prefill(target: TargetModel, drafter, prompt: mx.array, state: DecodeState, step_size: int) -> mx.array:
    """Run the prompt through the target in chunks, feeding each chunk's features to the drafter's cache.

    With a `state` from an earlier generation (a later chat turn), the prompt continues it: the last committed
    token and the features still waiting for the draft cache go in first.
    """
    if state.last_token >= 0:
        prompt = mx.concatenate([mx.array([state.last_token], dtype=prompt.dtype), prompt])
    if drafter is not None and state.pending_context is not None:
        drafter.append_context(state.pending_context, state.draft_cache)
    state.pending_context = None
    logits = None
    n = prompt.shape[0]
    for begin in range(0, n, step_size):
        chunk = prompt[begin : begin + step_size][None]
        logits, hidden = target(chunk, state.target_cache)
        if drafter is not None:
            drafter.append_context(hidden, state.draft_cache)
        mx.eval(logits[:, -1], [c.state for c in state.target_cache],
                [c.state for c in state.draft_cache] if state.draft_cache else [])
    return logits[0, -1]


def dflash_generate_step(
    prompt: mx.array,
    target: TargetModel,
    drafter=None,
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    mask_token_id: Optional[int] = None,
    stop_tokens: Sequence[int] = (),
    prefill_step_size: int = 2048,
    state: Optional[DecodeState] = None,
    acceptor=None,
    profiler=None,
) -> Generator[Cycle, None, None]:
    """DFlash decoding (greedy unless another acceptor is given).

    Args:
        prompt: 1-D token ids.
        target: the wrapped target model; its taps must be the drafter's `target_layer_ids`.
        drafter: a bound `DFlashDrafter` (or any object with `append_context`, `make_cache`, `__call__`);
            `None` means plain decoding through the same code.
        max_tokens: tokens to generate at most (-1: no limit).
        block_size: tokens verified per cycle (1 = plain decoding); defaults to the drafter's.
        mask_token_id: the drafter's mask id; defaults to `drafter.config.mask_token_id`.
        stop_tokens: generation stops after the first of these is committed.
        state: caches to start from (fresh if omitted).
        acceptor: the acceptance rule (`acceptance.GreedyAcceptor` by default).
        profiler: for benchmarks only: an object whose `mark(phase, *arrays)` is called at the end of each phase
            ("prefill", then per cycle "host", "draft", "verify", "host", "rollback") with the arrays to evaluate
            there; the extra syncs slow decoding (see `bench.methods.PhaseProfiler`).

    Yields:
        Cycle: the tokens each verify pass commits, in order.
    """
    if drafter is None:
        block_size = 1
    block_size = block_size or drafter.block_size
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if mask_token_id is None and drafter is not None:
        mask_token_id = drafter.config.mask_token_id
    if block_size > 1 and mask_token_id is None:
        raise ValueError("the drafter config has no mask_token_id")
    if state is None:
        state = DecodeState(target.make_cache(), drafter.make_cache() if drafter is not None else None)
    target.check_rollback_supported(state.target_cache)
    limit = float("inf") if max_tokens is None or max_tokens < 0 else max_tokens
    stops = set(int(t) for t in stop_tokens)
    acceptor = acceptor or GreedyAcceptor()
    # Tell the acceptor every token the target has seen (history-dependent logits processors need it).
    observe = getattr(acceptor, "observe", None) or (lambda tokens: None)
    observe(prompt)

    last_logits = _prefill(target, drafter, prompt, state, prefill_step_size)
    first = int(acceptor.first(last_logits).item())
    state.last_token = first
    observe([first])
    if profiler is not None:
        profiler.mark("prefill")
    yield Cycle([first], 0, 1, logits=last_logits[None], is_prefill=True)
    emitted = 1
    if first in stops or emitted >= limit:
        return

    def launch(block: int) -> _Pending:
        # Build draft + verify + acceptance for one cycle and queue it on the device.
        if profiler is not None:
            profiler.mark("host")
        context = None
        head = mx.array([[state.last_token]], dtype=mx.int32)
        if block > 1:
            if state.pending_context is not None:
                context, state.pending_context = state.pending_context, None
                drafter.append_context(context, state.draft_cache)
            block_ids = mx.array([[state.last_token] + [mask_token_id] * (block - 1)], dtype=mx.int32)
            if isinstance(acceptor, GreedyAcceptor) and hasattr(drafter, "greedy_draft"):
                # Greedy needs only the argmax: skip the drafter's full-vocabulary logits.
                draft_logits, draft = None, drafter.greedy_draft(block_ids, state.draft_cache)[0]
            else:
                draft_logits = drafter(block_ids, state.draft_cache)[0]
                draft = acceptor.propose(draft_logits)
            if profiler is not None:
                profiler.mark("draft", draft)
            verify_ids = mx.concatenate([head, draft[None]], axis=1)
        else:
            draft_logits = None
            draft = mx.zeros((0,), dtype=mx.int32)
            verify_ids = head
        logits, hidden = target(verify_ids, state.target_cache)
        acc, choice = acceptor.verify(draft, draft_logits, logits[0])
        packed = mx.concatenate([acc.reshape(1).astype(mx.int32), choice, draft])
        if profiler is not None:
            profiler.mark("verify", packed, hidden)
        mx.async_eval(packed, hidden)
        return _Pending(block, packed, logits[0], hidden, context)

    pending: Optional[_Pending] = None
    try:
        pending = launch(int(min(block_size, limit - emitted)))
        while pending is not None:
            cur, pending = pending, None
            values = cur.packed.tolist()  # the cycle's one host sync
            if profiler is not None:
                profiler.mark("host")
            acc, choice = values[0], values[1 : 1 + cur.block]
            tokens = values[1 + cur.block : 1 + cur.block + acc] + [choice[acc]]
            stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
            if stop_at is not None:
                tokens = tokens[: stop_at + 1]
            # The target cache holds the whole block; keep the committed prefix (the newest token is the next
            # block's slot 0, so it is not in the cache yet).
            keep = len(tokens)
            target.rollback(state.target_cache, cur.block - keep)
            if profiler is not None:
                profiler.mark("rollback", [c.state for c in state.target_cache])
            committed = cur.hidden[:, :keep]
            state.pending_context = (
                committed if state.pending_context is None
                else mx.concatenate([state.pending_context, committed], axis=1)
            )
            state.last_token = tokens[-1]
            observe(tokens)
            emitted += len(tokens)
            if stop_at is None and emitted < limit:
                pending = launch(int(min(block_size, limit - emitted)))
            yield Cycle(tokens, acc, cur.block, logits=cur.logits[: len(tokens)])
    finally:
        if pending is not None:
            # The caller stopped early: undo the queued cycle so the caches hold exactly the committed tokens.
            target.rollback(state.target_cache, pending.block)
            if pending.context is not None:
                for c in state.draft_cache:
                    c.trim(pending.context.shape[1])
                state.pending_context = pending.context
