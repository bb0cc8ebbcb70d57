"""Continuous batching: the verify passes of several concurrent generations run as one target pass.

A `Batch` holds one target and drafter and the generations currently decoding with them. Each generation is an
ordinary cycle generator (`Batch.generate_step`, the same arguments and `Cycle`s as `engine.dflash_generate_step`)
that prefills alone, then joins the batch; when it needs its next cycle and none is waiting for it, it runs one
pass for every member that wants one:

    per member:   choose its width, draft its block (its own draft cache and acceptor)
    all at once:  targets.ragged.ragged_forward: the blocks end to end for embedding, norms, MLP, LM head;
                  attention / GatedDeltaNet per member on its own caches
    per member:   verify with its acceptor; one host sync for the whole pass; roll its caches back to the kept
                  prefix; commit; its `Cycle` waits until its generator is advanced

Members join and leave between passes: one that finished, stopped or was closed is not in the next pass. Every
member's caches, acceptor state and random keys are exactly those of its generation alone, so its output is too
(greedy; and seeded sampling, whose widths follow its own acceptance, see below), up to the rounding of matmuls
over more rows. `BatchedGeneration` is `generation.Generation` with its cycles from a batch.

Widths: a member with a fixed width keeps it; a seeded sampling member keeps its own reproducible policy (its
widths, and so its random draws, must not depend on its neighbours); so does a member that also drafts by lookup
(its draft-source choice, `sources.SourceChoice`, is per request: the server's default). Its policy is fed the
shared pass's measured seconds, so its cost model sees what a pass costs with this batch. Any other adaptive
member uses the batch's shared `WidthPolicy` (`SharedWidth`): one choice per pass, from the same cost model fed
with the pass's seconds and every member's acceptance. Widths may differ within a pass (the forward is ragged).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .acceptance import Acceptor, GreedyAcceptor
from .engine import CLEAR_CACHE_EVERY, Cycle, DecodeState, cutting_policy, draft_block, prefill, resolve_options
from .generation import Generation
from .lookup import LookupIndex
from .sources import DFLASH, LOOKUP, PLAIN, SourceChoice
from ..targets.ragged import ragged_forward
from .width import Width, WidthPolicy, coordinate


class SharedWidth:
    """One `WidthPolicy` choosing for every member of a pass: the first `choose` of a pass decides, later ones in
    the same pass get the same width; each member's `record` feeds the policy (the pass's seconds, its acceptance)."""

    def __init__(self, batch: "Batch", policy: Width):
        self.batch, self.policy = batch, policy
        self._pass, self._width = -1, 1

    def choose(self) -> int:
        if self._pass != self.batch.passes:
            self._pass, self._width = self.batch.passes, self.policy.choose()
        return self._width

    def record(self, width: int, accepted: int, seconds: float) -> None:
        self.policy.record(width, accepted, seconds)


class _Member:
    """One generation's per-request state between passes."""

    def __init__(self, state: DecodeState, acceptor: Acceptor, width: Width, limit: float, stops: set,
                 mask_token_id: Optional[int], emitted: int, lookup: Optional[LookupIndex],
                 sources: Optional[SourceChoice]):
        self.state, self.acceptor, self.width = state, acceptor, width
        self.lookup, self.sources = lookup, sources
        self.limit, self.stops, self.mask_token_id = limit, stops, mask_token_id
        self.emitted = emitted
        self.wants = True  # wants another cycle
        self.ready: Optional[Cycle] = None  # a cycle computed by a pass, not yet yielded
        self.undo = None  # what `Batch._withdraw` needs to take `ready` back out of the caches
        self.error: Optional[BaseException] = None
        # This pass's launch: width, draft, draft logits, features flushed into the draft cache, packed result.
        self.w, self.source, self.draft, self.draft_logits, self.flushed = 1, PLAIN, None, None, None
        self.packed = self.logits = self.hidden = None


class Batch:
    """The generations decoding concurrently on one target/drafter pair (driven from one thread)."""

    def __init__(self, target, drafter=None):
        self.target, self.drafter = target, drafter
        self.members: List[_Member] = []
        self.passes = 0
        self.sizes: Dict[int, int] = {}  # members per pass -> passes (for the benchmark and the metrics)
        self._shared: Dict[int, SharedWidth] = {}

    def shared_width(self, max_width: int) -> SharedWidth:
        """The batch's adaptive width policy up to `max_width` (one per distinct maximum)."""
        if max_width not in self._shared:
            self._shared[max_width] = SharedWidth(self, coordinate(WidthPolicy(max_width)))
        return self._shared[max_width]

    # -- one generation --------------------------------------------------------------------------------------------
    def generate_step(self, prompt: mx.array, *, max_tokens: int = 256, block_size: Optional[int] = None,
                      mask_token_id: Optional[int] = None, stop_tokens: Sequence[int] = (),
                      prefill_step_size: int = 2048, state: Optional[DecodeState] = None,
                      acceptor: Optional[Acceptor] = None, width: Optional[Width] = None,
                      prefill_progress: Optional[Callable[[int, int], None]] = None,
                      lookup: Optional[LookupIndex] = None, sources: Optional[SourceChoice] = None
                      ) -> Generator[Cycle, None, None]:
        """`engine.dflash_generate_step` for a member of this batch (same arguments and cycles)."""
        target, drafter = self.target, self.drafter
        width, mask_token_id, state, limit, stops = resolve_options(
            target, drafter, max_tokens=max_tokens, block_size=block_size, mask_token_id=mask_token_id,
            stop_tokens=stop_tokens, state=state, width=width, lookup=lookup, sources=sources)
        acceptor = acceptor or GreedyAcceptor()

        # The prefill runs alone (between two passes of the others).
        acceptor.observe(prompt)
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
        yield Cycle([first], 0, 1, logits=last_logits[None], is_prefill=True)
        if first in stops or 1 >= limit:
            return
        member = _Member(state, acceptor, width, limit, stops, mask_token_id, 1, lookup, sources)
        self.members.append(member)
        try:
            while True:
                if member.ready is None and member.wants and member.error is None:
                    self.run_pass()
                if member.error is not None:
                    raise member.error
                if member.ready is None:
                    return
                cycle, member.ready = member.ready, None
                yield cycle
        finally:
            self.members.remove(member)
            if member.ready is not None and member.error is None:
                # Closed with a pass it never yielded (the others' pass ran for it too): the caches must hold
                # exactly the tokens the caller saw, as the engine's are when it is closed with a queued cycle.
                self._withdraw(member)

    # -- one pass for every member that wants one ------------------------------------------------------------------
    def run_pass(self) -> None:
        members = [m for m in self.members if m.wants and m.ready is None and m.error is None]
        if not members:
            return
        started = time.perf_counter()
        try:
            with mx.stream(generation_stream):
                for m in members:
                    self._draft(m)
                logits, hidden = ragged_forward(
                    self.target, [mx.concatenate([mx.array([[m.state.last_token]], dtype=mx.int32),
                                                  m.draft[None]], axis=1) for m in members],
                    [m.state.target_cache for m in members])
                for m, lg, hd in zip(members, logits, hidden):
                    acc, choice = m.acceptor.verify(m.draft, m.draft_logits, lg[0])
                    m.packed = mx.concatenate([acc.reshape(1).astype(mx.int32), choice, m.draft])
                    m.logits, m.hidden = lg[0], hd
                mx.eval([m.packed for m in members], [m.hidden for m in members])  # the pass's one sync
            seconds = time.perf_counter() - started
            for m in members:
                self._finish(m, m.packed.tolist(), seconds)
        except BaseException as e:
            # A failed pass may have half-written its members' caches: each of them ends with the error.
            for m in members:
                m.error, m.wants = e, False
            raise
        self.passes += 1
        self.sizes[len(members)] = self.sizes.get(len(members), 0) + 1
        if self.passes % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()

    def _draft(self, m: _Member) -> None:
        """Choose the member's width and draft source and draft its block, as the engine's `launch` does."""
        if m.sources is not None:
            m.sources.offer(m.lookup.propose(int(min(m.sources.lookup_width, m.limit - m.emitted)) - 1))
        m.w = w = int(min(m.width.choose(), m.limit - m.emitted))
        m.source = (m.sources.source if m.sources is not None else DFLASH) if w > 1 else PLAIN
        m.flushed, m.draft, m.draft_logits = None, mx.zeros((0,), dtype=mx.int32), None
        if m.source == LOOKUP:
            copied = m.sources.lookup_tokens[: w - 1]
            m.w = len(copied) + 1
            m.draft = m.acceptor.propose_tokens(mx.array(copied, dtype=mx.int32))
            return
        if w <= 1:
            return
        policy = cutting_policy(m.width.policy if isinstance(m.width, SharedWidth) else m.width)
        m.w, m.draft, m.draft_logits, m.flushed = draft_block(self.drafter, m.acceptor, m.state, w, m.mask_token_id,
                                                              policy)

    def _finish(self, m: _Member, values: List[int], seconds: float) -> None:
        """Accept, roll back to the kept prefix and commit, as the engine does after its sync."""
        w = m.w
        acc, choice = values[0], values[1: 1 + w]
        tokens = values[1 + w: 1 + w + acc] + [choice[acc]]
        stop_at = next((i for i, t in enumerate(tokens) if t in m.stops), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
        m.width.record(w, acc, seconds)
        keep = len(tokens)
        m.undo = (keep, m.flushed, m.state.last_token)
        self.target.rollback(m.state.target_cache, w - keep)
        m.state.commit(m.hidden[:, :keep] if self.drafter is not None else None, tokens[-1])
        m.acceptor.observe(tokens)
        if m.lookup is not None:
            m.lookup.extend(tokens)
        m.emitted += keep
        m.ready = Cycle(tokens, acc, w, logits=m.logits[:keep], source=m.source)
        m.wants = tokens[-1] not in m.stops and m.emitted < m.limit
        m.packed = m.hidden = m.logits = m.draft_logits = m.flushed = None

    def _withdraw(self, m: _Member) -> None:
        """Take the member's computed, unyielded cycle out of its caches: it committed `keep` tokens of the newest
        verify write, which the target can still drop, and appended their features to the waiting ones; undone,
        it is the engine's abandoned cycle (`DecodeState.abandon`)."""
        keep, flushed, last_token = m.undo
        state = m.state
        if self.drafter is not None and flushed is None:  # a lookup or plain pass: drop its appended features
            waiting = state.pending_context
            state.pending_context = waiting[:, :-keep] if waiting.shape[1] > keep else None
        state.abandon(self.target, self.drafter, keep, flushed)
        state.last_token = last_token
        m.ready = m.undo = None


class BatchedGeneration(Generation):
    """`generation.Generation` whose verify passes are shared with the other members of `batch`.

    Same arguments as `Generation` (its target and drafter must be the batch's), minus the profiler.
    """

    def __init__(self, batch: Batch, prompt, *, state: Optional[DecodeState] = None, width: Optional[int] = None,
                 width_policy: Optional[Width] = None, mask_token_id: Optional[int] = None,
                 prefill_step_size: int = 2048, prefill_progress=None, **kwargs: Any):
        super().__init__(batch.target, batch.drafter, prompt, state=state, width=width, width_policy=width_policy,
                         mask_token_id=mask_token_id, prefill_step_size=prefill_step_size,
                         prefill_progress=prefill_progress, **kwargs)
        self._cycles.close()  # the engine's own loop never started: nothing ran yet
        reproducible = kwargs.get("seed") is not None and not isinstance(self.acceptor, GreedyAcceptor)
        if self.adaptive and width_policy is None and not reproducible and self.sources is None:
            widest = kwargs.get("max_width") or batch.drafter.block_size
            self.width_policy = batch.shared_width(widest)
        drafter = batch.drafter
        self._cycles = batch.generate_step(
            self.prompt, max_tokens=self.max_tokens, block_size=width if drafter is not None else None,
            mask_token_id=mask_token_id, stop_tokens=self.stops, prefill_step_size=prefill_step_size, state=state,
            acceptor=self.acceptor, width=self.width_policy, prefill_progress=prefill_progress, lookup=self.lookup,
            sources=self.sources)
