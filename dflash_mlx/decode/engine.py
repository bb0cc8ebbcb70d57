"""The DFlash decoding loop: prefill, then per cycle draft a block, verify it in one target pass, accept the
matching prefix, roll the caches back to it and commit it.

`dflash_generate_step` yields one `Cycle` per verify pass (the first one is the prefill's token). Every committed
token is the target's own greedy choice given the committed prefix, so the output equals plain greedy decoding;
with a sampling acceptor (`acceptance.py`) it is distributed exactly as sampling the target alone.
The algorithm and its bookkeeping: docs/algorithm.md; the module map: docs/architecture.md.

Host/device overlap: each cycle's whole graph (draft, verify, acceptance) is queued with `mx.async_eval`, and the
only host sync is one `.tolist()` of the packed acceptance result. The next cycle is queued before the current
one's tokens are handed to the caller, so detokenizing and printing overlap the device work. As in mlx-lm, the
work runs on a dedicated generation stream and MLX's buffer cache is released between prefill chunks and every
few hundred cycles (both matter on Apple GPUs and cost nothing on the CPU backend).

Verify width: `block_size` fixes it; a `width` policy (`width.WidthPolicy`) chooses it before every cycle from the
time between consecutive syncs and the acceptance seen so far. Any sequence of widths commits the same tokens.

Confidence heads (DSpark): with an adaptive width, a drafter whose walk estimates each slot's acceptance drafts
the block the policy chose and the policy cuts it slot by slot on those estimates (`draft_block`); reading them
is one extra host sync per cycle, made only for such drafters.

Draft source: with a `lookup` index (`lookup.LookupIndex`) and a `sources` choice (`sources.SourceChoice`), each
cycle's draft is either the drafter's block, a continuation copied from the context, or nothing (plain decoding),
chosen with the width. The lookup runs on the host when the cycle is launched; that is right after the previous
cycle's sync, so it sees every committed token (the overlap is with the caller's work on the previous cycle, not
with the device). A copied draft goes through the same verify pass, acceptance (a point-mass proposal, see
`Acceptor.propose_tokens`), rollback and commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .acceptance import Acceptor, GreedyAcceptor
from ..errors import DFlashError
from .lookup import LookupIndex
from .sources import DFLASH, LOOKUP, PLAIN, SourceChoice
from ..targets import TargetModel
from .width import FixedWidth, Width, WidthPolicy

CLEAR_CACHE_EVERY = 256  # cycles between releases of MLX's buffer cache, as mlx-lm's decode loop does


class Drafter(Protocol):
    """What the loop needs from a drafter (`drafter.DFlashDrafter`, `oracle.OracleDrafter`)."""

    block_size: int
    mask_token_id: Optional[int]

    def make_cache(self) -> List[Any]: ...

    def append_context(self, target_hidden: mx.array, cache: List[Any]) -> None: ...

    def rollback(self, cache: List[Any], num_tokens: int) -> None: ...

    def __call__(self, block_ids: mx.array, cache: List[Any]) -> mx.array: ...

    # Optional: `draft_walk(block_ids, cache) -> acceptance.DraftWalk` for drafters whose slot i depends on the
    # token drafted at slot i-1; the engine then has the acceptor walk it instead of calling the drafter. A walk
    # with `has_confidence` also estimates each slot's acceptance (`walk.confidence()`): an adaptive width policy
    # then cuts the block it chose where those estimates say (`WidthPolicy.truncate`).


@dataclass
class Cycle:
    """Tokens committed by one verify pass."""

    tokens: List[int]
    accepted: int  # draft tokens accepted (0..width-1); the last token is always the target's bonus
    width: int  # tokens verified in this pass (1 for the prefill cycle)
    logits: Optional[mx.array] = None  # [len(tokens), V] target logits that chose each token (lazy)
    is_prefill: bool = False
    source: str = PLAIN  # where the drafts came from: "dflash", "lookup" or "plain" (no drafts)

    @property
    def block_size(self) -> int:
        """The pass's verify width under its earlier name (the drafter's block size is another thing)."""
        return self.width


@dataclass
class DecodeState:
    """Everything the loop carries between cycles: the caches, the last committed token (the next block's slot 0,
    not yet in the target cache) and the tapped features of committed tokens not yet in the draft cache."""

    target_cache: List[Any]
    draft_cache: Optional[List[Any]]
    last_token: int = -1
    pending_context: Optional[mx.array] = None  # [1, S, n*H] tapped features not yet in the draft cache
    extra: dict = field(default_factory=dict)

    @classmethod
    def fresh(cls, target: TargetModel, drafter: Optional[Drafter] = None) -> "DecodeState":
        """Empty caches for this target and drafter (no draft cache without a drafter)."""
        return cls(target.make_cache(), drafter.make_cache() if drafter is not None else None)

    def commit(self, features: Optional[mx.array], last_token: int) -> None:
        """Record a cycle's committed tokens: their tapped features wait for the next draft (None: no drafter
        will read them)."""
        if features is not None:
            self.pending_context = (features if self.pending_context is None
                                    else mx.concatenate([self.pending_context, features], axis=1))
        self.last_token = last_token

    def flush_context(self, drafter: Optional[Drafter]) -> Optional[mx.array]:
        """Hand the waiting features to the draft cache; returns them (None if there were none)."""
        context, self.pending_context = self.pending_context, None
        if context is not None and drafter is not None:
            drafter.append_context(context, self.draft_cache)
        return context

    def abandon(self, target: TargetModel, drafter: Optional[Drafter], width: int,
                flushed: Optional[mx.array]) -> None:
        """Undo a queued cycle of `width` tokens whose draft took the features `flushed` from the queue."""
        target.rollback(self.target_cache, width)
        if flushed is not None:
            drafter.rollback(self.draft_cache, flushed.shape[1])
            self.pending_context = flushed


def prefill(target: TargetModel, drafter: Optional[Drafter], prompt: mx.array, state: DecodeState,
            step_size: int = 2048, progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
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


@dataclass
class _Pending:
    """A queued cycle: the device is computing it while the host yields the previous one."""

    width: int
    source: str
    packed: mx.array  # [acc, choice_0..choice_{w-1}, draft_1..draft_{w-1}]
    logits: mx.array  # [w, V]
    hidden: mx.array  # [1, w, n*H]
    flushed: Optional[mx.array]  # features this cycle moved into the draft cache (restored if abandoned)


def _accept(values: List[int], width: int, stops: set) -> Tuple[List[int], int]:
    """(tokens to commit, drafts accepted) from a cycle's packed result; a stop token ends the commit."""
    acc, choice = values[0], values[1 : 1 + width]
    tokens = values[1 + width : 1 + width + acc] + [choice[acc]]
    stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
    return (tokens if stop_at is None else tokens[: stop_at + 1]), acc


def cutting_policy(width: Any) -> Optional[WidthPolicy]:
    """The adaptive width policy behind a width choice, which may cut a confident block short (None: the width
    is fixed, or coordinated with other ranks, which must all choose alike)."""
    if isinstance(width, SourceChoice):
        width = width.dflash
    return width if isinstance(width, WidthPolicy) else None


def draft_block(drafter: Drafter, acceptor: Acceptor, state: DecodeState, width: int, mask_token_id: int,
                policy: Optional[WidthPolicy] = None) -> Tuple[int, mx.array, Optional[mx.array], Optional[mx.array]]:
    """Draft one block of `width` tokens (the anchor and width-1 drafts): (width, draft [width-1], draft logits
    or None, features moved into the draft cache). With a `policy`, a drafter whose walk has a confidence head
    has the block cut where its estimates say, so the width returned may be narrower (one host sync for them)."""
    flushed = state.flush_context(drafter)
    walk_drafter = hasattr(drafter, "draft_walk")
    confident = walk_drafter and policy is not None and bool(getattr(drafter, "has_confidence", False))
    block_ids = mx.array([[state.last_token] + [mask_token_id] * (width - 1)], dtype=mx.int32)
    draft_logits = None
    if walk_drafter:
        # Slot i's proposal depends on draft i-1 (DSpark, DFlash 2): the acceptor walks the slots.
        walk = drafter.draft_walk(block_ids, state.draft_cache)
        draft = acceptor.propose_walk(walk, state.last_token)
        if confident:
            width = policy.truncate(walk.confidence().tolist(), width)
            draft = acceptor.truncate(draft, width - 1)
    elif isinstance(acceptor, GreedyAcceptor) and hasattr(drafter, "greedy_draft"):
        # Greedy needs only the argmax: skip the drafter's full-vocabulary logits.
        draft = drafter.greedy_draft(block_ids, state.draft_cache)[0]
    else:
        draft_logits = drafter(block_ids, state.draft_cache)[0]
        draft = acceptor.propose(draft_logits)
    return width, draft, draft_logits, flushed


def resolve_options(target: TargetModel, drafter: Optional[Drafter], *, max_tokens, block_size, mask_token_id,
                    stop_tokens, state, width, lookup, sources):
    """The loop's settings from `dflash_generate_step`'s arguments (see there), checked: (width choice, mask id,
    state, token limit, stop set). Shared with the batched loop (`batching.py`)."""
    if sources is not None and lookup is None:
        raise DFlashError("a draft-source choice needs a lookup index")
    if sources is not None and block_size is None:
        width = width or sources
    elif drafter is None:
        block_size = 1
    if block_size is not None or width is None:
        block_size = block_size or drafter.block_size
        if block_size < 1:
            raise DFlashError(f"block_size must be >= 1, got {block_size}")
        width = FixedWidth(block_size)
    if mask_token_id is None and drafter is not None:
        mask_token_id = drafter.mask_token_id
    if drafter is not None and mask_token_id is None and (block_size is None or block_size > 1) and sources is None:
        raise DFlashError("the drafter config has no mask_token_id; set it in the drafter's config.json")
    state = state or DecodeState.fresh(target, drafter)
    target.check_rollback_supported(state.target_cache)
    limit = float("inf") if max_tokens is None or max_tokens < 0 else max_tokens
    stops = set(int(t) for t in stop_tokens)
    return width, mask_token_id, state, limit, stops


def dflash_generate_step(
    prompt: mx.array,
    target: TargetModel,
    drafter: Optional[Drafter] = None,
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    mask_token_id: Optional[int] = None,
    stop_tokens: Sequence[int] = (),
    prefill_step_size: int = 2048,
    state: Optional[DecodeState] = None,
    acceptor: Optional[Acceptor] = None,
    width: Optional[Width] = None,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    profiler=None,
    lookup: Optional[LookupIndex] = None,
    sources: Optional[SourceChoice] = None,
) -> Generator[Cycle, None, None]:
    """DFlash decoding (greedy unless another acceptor is given).

    Args:
        prompt: 1-D token ids.
        target: the wrapped target model; its taps must be the drafter's `target_layer_ids`.
        drafter: a bound drafter (see `Drafter`); `None` means plain decoding through the same code.
        max_tokens: tokens to generate at most (-1: no limit).
        block_size: tokens verified per cycle (1 = plain decoding); defaults to the drafter's unless `width` is
            given.
        width: chooses the verify width before each cycle (e.g. `width.WidthPolicy(drafter.block_size)`) and is
            told each cycle's width, accepted drafts and seconds; ignored when `block_size` is given.
        mask_token_id: the drafter's mask id; defaults to `drafter.mask_token_id`.
        stop_tokens: generation stops after the first of these is committed.
        state: caches to start from (fresh if omitted).
        acceptor: the acceptance rule (`acceptance.GreedyAcceptor` by default).
        prefill_progress: called as `(tokens_done, total)` after each prefill chunk (a progress bar).
        lookup: the context index for copied drafts; it is extended with the prompt and every committed token.
        sources: chooses each cycle's draft source and width (`width`, if given, is this object or its
            coordinated wrapper); requires `lookup`. Without a drafter it chooses between lookup and plain decoding.
        profiler: for benchmarks only: an object whose `mark(phase, *arrays)` is called at the end of each phase
            ("prefill", then per cycle "host", "draft", "verify", "host", "rollback") with the arrays to evaluate
            there; the extra syncs slow decoding (see `bench.methods.PhaseProfiler`).

    Yields:
        Cycle: the tokens each verify pass commits, in order.
    """
    width, mask_token_id, state, limit, stops = resolve_options(
        target, drafter, max_tokens=max_tokens, block_size=block_size, mask_token_id=mask_token_id,
        stop_tokens=stop_tokens, state=state, width=width, lookup=lookup, sources=sources)
    acceptor = acceptor or GreedyAcceptor()
    mark = profiler.mark if profiler is not None else (lambda phase, *arrays: None)

    # Prefill: the prompt's features go to the draft cache, its last logits choose the first token.
    acceptor.observe(prompt)  # history-dependent logits processors see every token the target has seen
    if lookup is not None:
        lookup.extend(prompt.tolist())
    if sources is None:
        lookup = None  # fixed widths draft from the drafter alone
    last_logits = prefill(target, drafter, prompt, state, prefill_step_size, prefill_progress)
    first = int(acceptor.first(last_logits).item())
    state.last_token = first
    acceptor.observe([first])
    if lookup is not None:
        lookup.extend([first])
    mark("prefill")
    yield Cycle([first], 0, 1, logits=last_logits[None], is_prefill=True)
    emitted = 1
    if first in stops or emitted >= limit:
        return

    def launch() -> _Pending:
        """Draft, verify and accept one block, queued on the device; its width is chosen now."""
        mark("host")
        if sources is not None:
            # The context's continuation is looked up now, on the host: every committed token is known here.
            sources.offer(lookup.propose(int(min(sources.lookup_width, limit - emitted)) - 1))
        w = int(min(width.choose(), limit - emitted))
        source = (sources.source if sources is not None else DFLASH) if w > 1 else PLAIN
        head = mx.array([[state.last_token]], dtype=mx.int32)
        flushed, draft, draft_logits = None, mx.zeros((0,), dtype=mx.int32), None
        with mx.stream(generation_stream):
            if source == LOOKUP:
                copied = sources.lookup_tokens[: w - 1]
                w = len(copied) + 1
                draft = acceptor.propose_tokens(mx.array(copied, dtype=mx.int32))
                mark("draft", draft)
            elif w > 1:
                w, draft, draft_logits, flushed = draft_block(drafter, acceptor, state, w, mask_token_id,
                                                              cutting_policy(width))
                mark("draft", draft)
            logits, hidden = target(mx.concatenate([head, draft[None]], axis=1), state.target_cache)
            acc, choice = acceptor.verify(draft, draft_logits, logits[0])
            packed = mx.concatenate([acc.reshape(1).astype(mx.int32), choice, draft])
        mark("verify", packed, hidden)
        mx.async_eval(packed, hidden)
        return _Pending(w, source, packed, logits[0], hidden, flushed)

    cycles, synced = 0, time.perf_counter()
    pending: Optional[_Pending] = launch()
    try:
        while pending is not None:
            cur, pending = pending, None
            tokens, acc = _accept(cur.packed.tolist(), cur.width, stops)  # the cycle's one host sync
            # The time between two syncs is one cycle's cost (the next cycle was queued right after the last one).
            now = time.perf_counter()
            width.record(cur.width, acc, now - synced)
            synced = now
            mark("host")
            # The target cache holds the whole block; keep the committed prefix (the newest token is the next
            # block's slot 0, so it is not in the cache yet).
            keep = len(tokens)
            target.rollback(state.target_cache, cur.width - keep)
            mark("rollback", [c.state for c in state.target_cache])
            state.commit(cur.hidden[:, :keep] if drafter is not None else None, tokens[-1])
            acceptor.observe(tokens)
            if lookup is not None:
                lookup.extend(tokens)
            emitted += keep
            cycles += 1
            if cycles % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
            if tokens[-1] not in stops and emitted < limit:
                pending = launch()
            yield Cycle(tokens, acc, cur.width, logits=cur.logits[:keep], source=cur.source)
    finally:
        if pending is not None:
            # The caller stopped early: undo the queued cycle so the caches hold exactly the committed tokens.
            state.abandon(target, drafter, pending.width, pending.flushed)
