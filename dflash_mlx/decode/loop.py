"""The single-stream decoding loop: prefill, then one verify pass after another, each through the pass step.

`dflash_generate_step` yields one `Pass` per verify pass (the first is the prefill's token). Every committed token
is the target's own greedy choice given the committed prefix, so the output equals plain greedy decoding; with a
sampling acceptor (`acceptance.py`) it is distributed exactly as sampling the target alone. The algorithm and its
bookkeeping: docs/algorithm.md; the module map: docs/architecture.md.

Host/device overlap: each pass's whole graph (draft, verify, acceptance) is queued with `mx.async_eval`, and the
only host sync is one `.tolist()` of the packed acceptance result. The next pass is queued before the current
one's tokens are handed to the caller, so detokenizing and printing overlap the device work. As in mlx-lm, the
work runs on a dedicated generation stream and MLX's buffer cache is released between prefill chunks and every
few hundred passes (both matter on Apple GPUs and cost nothing on the CPU backend).

Width and proposer: a `planner.Planner` chooses both before every pass from the time between consecutive syncs and
the acceptance seen so far (or `width=N` fixes the width). Any sequence of choices commits the same tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Generator, Optional, Sequence

import mlx.core as mx

from ..targets import TargetModel
from .acceptance import Acceptor, GreedyAcceptor, reproducible
from .lookup import LookupIndex
from .planner import Planner, planner_for
from .proposers import Proposer
from .proposers.dflash import Drafter
from .sources import SourceChoice
from .state import DecodeState
from .step import Decoder, Launch, Pass, check_ready, drafting_proposer, proposers_for

def dflash_generate_step(
    prompt: mx.array,
    target: TargetModel,
    drafter: Optional[Drafter] = None,
    *,
    max_tokens: int = 256,
    width: Optional[int] = None,
    planner: Optional[Planner] = None,
    mask_token_id: Optional[int] = None,
    stop_tokens: Sequence[int] = (),
    prefill_step_size: int = 2048,
    state: Optional[DecodeState] = None,
    acceptor: Optional[Acceptor] = None,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    profiler=None,
    lookup: Optional[LookupIndex] = None,
    sources: Optional[SourceChoice] = None,
    proposer: Optional[Proposer] = None,
    tree_budget=None,
) -> Generator[Pass, None, None]:
    """DFlash decoding (greedy unless another acceptor is given).

    Args:
        prompt: 1-D token ids.
        target: the wrapped target model; its taps must be the drafter's `target_layer_ids`.
        drafter: a bound drafter (see `proposers.dflash.Drafter`); `None` means plain decoding through the same code.
        max_tokens: tokens to generate at most (-1: no limit).
        width: tokens verified per pass (1 = plain decoding); defaults to the drafter's block unless a `planner`
            is given.
        planner: chooses each pass's proposer and width (`planner.Planner`, `planner.build_planner`).
        mask_token_id: the drafter's mask id; defaults to `drafter.mask_token_id`.
        stop_tokens: generation stops after the first of these is committed.
        state: caches to start from (fresh if omitted).
        acceptor: the acceptance rule (`acceptance.GreedyAcceptor` by default).
        prefill_progress: called as `(tokens_done, total)` after each prefill chunk (a progress bar).
        lookup, sources: prompt lookup: the context index (extended with the prompt and every committed token)
            and the choice between it, the drafter and plain decoding (`sources.SourceChoice`).
        profiler: for benchmarks only: an object whose `mark(phase, *arrays)` is called at the end of each phase
            ("prefill", then per pass "host", "draft", "verify", "host", "rollback") with the arrays to evaluate
            there; the extra syncs slow decoding (see `bench.methods.PhaseProfiler`).
        proposer: a proposer for passes wider than 1 instead of the drafter's blocks (`proposers.Proposer`).
        tree_budget: drafting passes verify a DDTree of up to this many drafted nodes, in one target pass (an int),
            or the planner chooses chain or budget by measured speed ("auto"); None: chains.

    Yields:
        Pass: the tokens each verify pass commits, in order.
    """
    drafting = drafting_proposer(drafter, proposer, mask_token_id)
    state = state or DecodeState.fresh(target, drafter)
    acceptor = acceptor or GreedyAcceptor()
    plan = planner_for(drafting, width=width, planner=planner, sources=sources,
                       lookup=lookup, tree_budget=tree_budget,
                       reproducible=reproducible(acceptor),  # a seeded run: budgets by acceptance
                       target=target, cache=state.target_cache, acceptor=acceptor)
    check_ready(drafting, plan)
    decoder = Decoder(target, drafter, proposers_for(drafting, lookup if plan.choice is not None else None), plan,
                      acceptor, state, max_tokens=max_tokens, stops=stop_tokens,
                      mark=profiler.mark if profiler is not None else None)
    yield decoder.start(prompt, prefill_step_size, prefill_progress)
    if not decoder.wants:
        return

    def launch() -> Launch:
        """Draft, verify and accept one block, queued on the device."""
        proposal = decoder.propose()
        logits, hidden, write = decoder.forward(proposal)
        queued = decoder.verify(proposal, logits[0], hidden, write)
        mx.async_eval(queued.packed, hidden)
        return queued

    synced = time.perf_counter()
    pending: Optional[Launch] = launch()
    try:
        while pending is not None:
            current, pending = pending, None
            values = current.packed.tolist()  # the pass's one host sync
            # The time between two syncs is one pass's cost (the next pass was queued right after the last one).
            now = time.perf_counter()
            done = decoder.finish(current, values, now - synced)
            synced = now
            if decoder.wants:
                pending = launch()
            yield done
    finally:
        if pending is not None:
            # The caller stopped early: undo the queued pass so the caches hold exactly the committed tokens.
            decoder.withdraw(pending)
