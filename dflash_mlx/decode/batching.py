"""Continuous batching: the verify passes of several concurrent generations run as one target pass.

A `Batch` holds one target and drafter and the generations currently decoding with them. Each generation is a
pass generator (`Batch.generate_step`, yielding `step.Pass`es as `loop.dflash_generate_step` does) that prefills
alone, then joins the batch; when it needs its next pass and none is waiting for it, it runs one pass for every
member that wants one, through the same pass step (`step.Decoder`) as the single-stream loop:

    per member:   plan and draft (`Decoder.propose`: its own planner, proposers, draft cache and acceptor): a chain
                  or a draft tree
    all at once:  targets.walk: every member's block (a `Chain`) or tree (a `Tree`) as one segment of one pass:
                  end to end for embedding, norms, MLP, LM head; attention / GatedDeltaNet per member on its
                  own caches
    per member:   `Decoder.verify`; one host sync for the whole pass; `Decoder.finish`; its `Pass` waits until
                  its generator is advanced

Members join and leave between passes: one that finished, stopped or was closed is not in the next pass. Every
member's caches, acceptor state and random keys are exactly those of its generation alone, so its output is too
(greedy; and seeded sampling, whose widths follow its own acceptance), up to the rounding of matmuls over more
rows. `BatchedGeneration` is `generation.Generation` with its passes from a batch.

Planners: a member with a fixed width keeps it; a seeded sampling member keeps its own reproducible planner (its
widths, and so its random draws, must not depend on its neighbours); so does a member that also drafts by lookup
(its choice is per request: the server's default). Its planner is fed the shared pass's measured seconds, so its
cost model sees what a pass costs with this batch. Any other adaptive member uses the batch's shared planner
(`SharedWidth`): one choice per pass, from the same cost model fed with the pass's seconds and every member's
acceptance. Widths and shapes may differ within a pass (the forward is ragged: no padding).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .acceptance import Acceptor, GreedyAcceptor
from .generation import Generation
from .lookup import LookupIndex
from .planner import Planner, pace, planner_for
from .proposal import Proposal
from .proposers import Proposer
from .state import DecodeState
from .step import CLEAR_CACHE_EVERY, Decoder, Launch, Pass, check_ready, drafting_proposer, proposers_for
from .width import Width, WidthPolicy


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
    """One generation's pass step and what the batch's last pass left for it."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.ready: Optional[Pass] = None  # a pass computed by the batch, not yet yielded
        self.launch: Optional[Launch] = None  # its launch, kept to take it back if it is never yielded
        self.error: Optional[BaseException] = None

    @property
    def wants(self) -> bool:
        return self.decoder.wants and self.error is None


class Batch:
    """The generations decoding concurrently on one target/drafter pair (driven from one thread)."""

    def __init__(self, target, drafter=None):
        self.target, self.drafter = target, drafter
        self.members: List[_Member] = []
        self.passes = 0
        self.sizes: Dict[int, int] = {}  # members per pass -> passes (for the benchmark and the metrics)
        self.tree_passes = 0  # members' passes that verified a draft tree
        self._shared: Dict[int, Planner] = {}

    def shared_planner(self, max_width: int) -> Planner:
        """The batch's adaptive planner up to `max_width` (one per distinct maximum)."""
        if max_width not in self._shared:
            policy = WidthPolicy(max_width)
            paced, cutter = pace(policy, policy)
            self._shared[max_width] = Planner(SharedWidth(self, paced), cutter=cutter)
        return self._shared[max_width]

    # -- one generation --------------------------------------------------------------------------------------------
    def generate_step(self, prompt: mx.array, *, max_tokens: int = 256, width=None,
                      planner: Optional[Planner] = None, mask_token_id: Optional[int] = None,
                      stop_tokens: Sequence[int] = (), prefill_step_size: int = 2048,
                      state: Optional[DecodeState] = None, acceptor: Optional[Acceptor] = None,
                      prefill_progress: Optional[Callable[[int, int], None]] = None,
                      lookup: Optional[LookupIndex] = None,
                      proposer: Optional[Proposer] = None) -> Generator[Pass, None, None]:
        """`loop.dflash_generate_step` for a member of this batch: the same passes, and the same arguments but
        for `sources=` (a planner carries its choice) and the profiler (one pass is many generations' work)."""
        target, drafter = self.target, self.drafter
        drafting = drafting_proposer(drafter, proposer, mask_token_id)
        planner = planner_for(drafting, width=width, planner=planner)
        check_ready(drafting, planner)
        state = state or DecodeState.fresh(target, drafter)
        index = lookup if planner.choice is not None else None
        decoder = Decoder(target, drafter, proposers_for(drafting, index), planner, acceptor or GreedyAcceptor(),
                          state, max_tokens=max_tokens, stops=stop_tokens, clears_cache=False)
        # The prefill runs alone (between two passes of the others).
        yield decoder.start(prompt, prefill_step_size, prefill_progress)
        if not decoder.wants:
            return
        member = _Member(decoder)
        self.members.append(member)
        try:
            while True:
                if member.ready is None and member.wants:
                    self.run_pass()
                if member.error is not None:
                    raise member.error
                if member.ready is None:
                    return
                done, member.ready = member.ready, None
                yield done
        finally:
            self.members.remove(member)
            if member.ready is not None and member.error is None:
                # Closed with a pass it never yielded (the others' pass ran for it too): the caches must hold
                # exactly the tokens the caller saw, as the loop's are when it is closed with a queued pass.
                member.decoder.take_back(member.launch)
                member.ready = member.launch = None

    # -- one pass for every member that wants one ------------------------------------------------------------------
    def run_pass(self) -> None:
        members = [m for m in self.members if m.wants and m.ready is None]
        if not members:
            return
        started = time.perf_counter()
        try:
            proposals = [m.decoder.propose() for m in members]
            outputs = self._forward(members, proposals)
            launches = [m.decoder.verify(p, lg, hd, write)
                        for m, p, (lg, hd, write) in zip(members, proposals, outputs)]
            mx.eval([q.packed for q in launches], [q.hidden for q in launches])  # the pass's one sync
            seconds = time.perf_counter() - started
            for m, queued in zip(members, launches):
                m.ready, m.launch = m.decoder.finish(queued, queued.packed.tolist(), seconds), queued
        except BaseException as e:
            # A failed pass may have half-written its members' caches: each of them ends with the error.
            for m in members:
                m.error = e
            raise
        self.passes += 1
        self.sizes[len(members)] = self.sizes.get(len(members), 0) + 1
        if self.passes % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()


    def _forward(self, members: List[_Member], proposals: List[Proposal]) -> List[Tuple[mx.array, mx.array, Any]]:
        """Each member's (logits [w, V], features [1, w, n*H], tree write or None) from ONE target pass over every
        member's segment, chains and trees alike (`targets.walk`)."""
        segments = [m.decoder.segment(p) for m, p in zip(members, proposals)]
        with mx.stream(generation_stream):
            logits, hidden = self.target.forward_segments(segments)
        writes = [getattr(s, "write", None) for s in segments]
        self.tree_passes += sum(w is not None for w in writes)
        return [(lg[0], hd, w) for lg, hd, w in zip(logits, hidden, writes)]


class BatchedGeneration(Generation):
    """`generation.Generation` whose verify passes are shared with the other members of `batch`.

    Same arguments as `Generation` (its target and drafter must be the batch's), minus the profiler.
    """

    def __init__(self, batch: Batch, prompt, **kwargs: Any):
        self.batch = batch
        super().__init__(batch.target, batch.drafter, prompt, **kwargs)

    def _shared_planner(self, widest: int) -> Optional[Planner]:
        return self.batch.shared_planner(widest)

    def _passes(self, *, state, mask_token_id, prefill_step_size, prefill_progress, profiler) -> Any:
        return self.batch.generate_step(self.prompt, max_tokens=self.max_tokens, planner=self.planner,
                                        mask_token_id=mask_token_id, stop_tokens=self.stops,
                                        prefill_step_size=prefill_step_size, state=state, acceptor=self.acceptor,
                                        prefill_progress=prefill_progress, lookup=self.lookup,
                                        proposer=self.proposer)
