"""One generation, as every front end drives it: the acceptance rule, the planner, the statistics, the collapse
watch and the detokenizer are built here, once, and the loop's verify passes come out as `Pass`es.

    gen = Generation(target, drafter, prompt_ids, tokenizer=tokenizer, max_tokens=64, temp=0.7, seed=1)
    for p in gen:
        print(p.text, end="")      # p.tokens, p.segments, p.accepted, p.width, p.logits, p.finish_reason
    gen.stats.tau

`api.stream_generate` turns passes into per-token responses, the server into deltas with stop strings and the
prefix cache, the bench into timed chunks. The rules that used to live in each of them live here:
- sampling keywords make the acceptor (`acceptance.make_acceptor`); a ready acceptor may be given instead;
- the planner (`planner.build_planner`): a fixed `width`, else widths and proposers chosen every pass; with
  `lookup` on (the default with a drafter and a chosen width; `lookup=True` without a drafter is lookup alone)
  each pass drafts from the drafter, from the context (`lookup.LookupIndex`, kept in `state.extra["lookup"]` so a
  chat's later turns and a server's cached prefix (`history`) are searched too) or not at all;
- statistics (`stats.AcceptanceStats`) and the acceptance-collapse watch: one warning per generation, logged when
  the generation ends (after its last text), so that it never splits the text a terminal is showing;
- detokenization: each committed token's text segment, as mlx-lm's streaming detokenizer gives it.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..errors import DFlashError
from .acceptance import Acceptor, make_acceptor, reproducible
from .budget import default_trees
from .lookup import LookupIndex
from .memory import PlannerMemory
from .loop import dflash_generate_step
from .planner import Planner, build_planner, tree_chooser, with_trees
from .proposers.mtp import MTP
from .sources import SourceChoice
from .state import DecodeState
from .stats import AcceptanceStats, CollapseWatch
from .step import Pass, drafting_proposer

logger = logging.getLogger("dflash_mlx")


class Generation:
    """A DFlash generation of `prompt` (token ids) by `target` with `drafter` (None: plain decoding, same loop).

    Args:
        target: the wrapped target (`models.loading.prepare`); drafter: a bound drafter or None.
        prompt: token ids (1-D `mx.array` or list); with `state`, they continue it.
        tokenizer: an mlx-lm `TokenizerWrapper`: its EOS ids stop the generation and its detokenizer fills each
            pass's `segments`; None for token-only use (the bench), stopping at `stop_tokens` alone.
        max_tokens: the most tokens to commit (-1: no limit).
        width: fixes the tokens verified per pass (1: plain decoding); None lets a planner choose before every
            pass (`planner`, by default an adaptive one up to `max_width`, the drafter's block unless given).
        planner: a ready `planner.Planner`, or a width policy object (`width.WidthPolicy` shape) to plan with.
        acceptor: a ready acceptance rule, instead of the `sampling` keywords of `acceptance.make_acceptor`.
        state: caches to continue from; history: tokens already in those caches (logits processors see them).
        stop_tokens: extra stop ids (the tokenizer's EOS ids always stop).
        tokenizer_lock: held while detokenizing (the server shares its tokenizer with other threads).
        warn_collapse: log one warning (logger "dflash_mlx") when drafts were almost never accepted, once the
            generation has ended; `collapse_warning` holds it from the pass where it was noticed.
        log_collapse: False: watch for the collapse and hold the warning, but leave logging it to the caller (a
            server that sees many generations logs the first and counts the rest).
        lookup: draft from the context too (None: on when there is a drafter; True without a drafter: lookup
            alone). Only with a chosen width (no `width`, no `planner`). lookup_width: widest lookup pass.
        proposer: a proposer for passes wider than 1 instead of the drafter's blocks (`proposers.Proposer`).
        prefill_step_size, prefill_progress, mask_token_id, profiler: as `loop.dflash_generate_step` takes them.
        tree_budget: drafting passes verify a DDTree of up to this many drafted nodes in one target pass (an int),
            or the planner chooses chain or budget by measured speed ("auto"); None: chains; `budget.DEFAULT_TREES`
            (what the front ends pass when the user chose nothing): `budget.default_trees` decides.
        memory: a `memory.PlannerMemory`: the planner starts from what earlier generations measured and leaves
            what it learnt there when this one ends (not for seeded sampling, which must follow from its seed).
    """

    def __init__(self, target, drafter, prompt, *, tokenizer=None, max_tokens: int = 256,
                 width: Optional[int] = None, planner=None, max_width: Optional[int] = None,
                 acceptor: Optional[Acceptor] = None, state: Optional[DecodeState] = None,
                 history: Optional[Sequence[int]] = None, stop_tokens: Sequence[int] = (),
                 tokenizer_lock: Optional[ContextManager] = None, warn_collapse: bool = True,
                 log_collapse: bool = True, prefill_step_size: int = 2048, prefill_progress: Optional[Callable[[int, int], None]] = None,
                 mask_token_id: Optional[int] = None, profiler=None, lookup: Optional[bool] = None,
                 lookup_width: int = 32, proposer=None, tree_budget=None,
                 memory: Optional[PlannerMemory] = None, **sampling):
        if max_tokens == 0:
            raise DFlashError("max_tokens must be non-zero (use -1 for no limit)")
        # A front end's "the user chose nothing" (DEFAULT_TREES) becomes a budget here, for every front end alike.
        tree_budget = default_trees(tree_budget, width, sampling.get("seed"), planner)
        if acceptor is None:
            acceptor = _acceptor(sampling)
        elif sampling:
            raise DFlashError(f"give either acceptor= or sampling options ({', '.join(sampling)}), not both")
        self.acceptor = acceptor
        self.target, self.drafter = target, drafter
        self.prompt = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt), dtype=mx.int32)
        if self.prompt.size == 0:
            raise DFlashError("the prompt is empty")
        self.max_tokens = max_tokens
        self.proposer = drafting_proposer(drafter, proposer, mask_token_id)
        drafting = self.proposer is not None
        use_lookup = (drafting if lookup is None else bool(lookup)) and width is None and planner is None
        # A fixed tree budget drafts every pass however little is accepted (like a fixed width).
        self.adaptive = (drafting or use_lookup) and width is None and not isinstance(tree_budget, int)
        # Sampled output must follow from the seed alone, so then widths follow acceptance, not the clock.
        seeded = reproducible(acceptor)
        # The caches are known now (fresh ones unless continued): whether trees can run on them is the planner's.
        state = state if state is not None else DecodeState.fresh(target, drafter)
        runs_on = dict(drafting=self.proposer, target=target, cache=state.target_cache, acceptor=acceptor)
        if width is not None:
            planner = None  # a fixed width wins over any planner
        elif planner is not None and not isinstance(planner, Planner):
            planner = build_planner(drafting=self.proposer, policy=planner)
        if planner is None:
            planner = build_planner(width=width, max_width=max_width, lookup=use_lookup, lookup_width=lookup_width,
                                    reproducible=seeded, shared=self._shared_planner, tree_budget=tree_budget,
                                    **runs_on)
        else:  # a planner of the caller's: its own trees, else as `tree_budget` says, where they can run
            own = planner.trees if planner.trees is not None else tree_chooser(tree_budget, seeded)
            with_trees(planner, own, **runs_on)
        self.planner: Planner = planner
        # Seeded sampling must follow from its seed alone: it neither starts from nor leaves measurements.
        self.memory = memory if not seeded else None
        if self.memory is not None:
            self.memory.seed(self.planner)
        self.sources: Optional[SourceChoice] = self.planner.choice
        self.lookup = _lookup_index(state, history) if use_lookup else None
        self.stats = AcceptanceStats(adaptive=self.adaptive)
        # A drafter we picked for this target by name is known to fit it; any other may be made for another one.
        made_for = getattr(drafter, "made_for", None)
        own_layers = self.proposer is not None and self.proposer.name == MTP
        self.watch = (CollapseWatch(made_for=made_for, fixed_trees=isinstance(tree_budget, int), own_layers=own_layers)
                      if warn_collapse else None)
        self.collapse_warning: Optional[str] = None
        self._warned = not log_collapse  # True: nothing left to log
        self.drafted = self.accepted = 0  # draft tokens proposed / accepted over the verify passes
        self.tokens_generated = 0
        self.prefill_seconds = self.started = 0.0
        self.finish_reason: Optional[str] = None
        self.tokenizer = tokenizer
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.stops = self.eos | set(int(t) for t in stop_tokens)
        self._lock = tokenizer_lock or nullcontext()
        self._detokenizer = None
        if tokenizer is not None:
            with self._lock:
                self._detokenizer = tokenizer.detokenizer  # mlx-lm hands out a fresh copy per access
                self._detokenizer.reset()
        if history is not None and len(history):
            acceptor.observe(mx.array(list(history), dtype=mx.int32))
        self._cycles = self._passes(state=state, mask_token_id=mask_token_id, prefill_step_size=prefill_step_size,
                                    prefill_progress=prefill_progress, profiler=profiler)

    def _shared_planner(self, widest: int) -> Optional[Planner]:
        """A planner shared with other generations (a batch's), or None: this one plans alone."""
        return None

    def _passes(self, **options) -> Iterator[Pass]:
        """The decoding loop this generation's passes come from (a batch's, in `batching.BatchedGeneration`)."""
        return dflash_generate_step(self.prompt, self.target, self.drafter, max_tokens=self.max_tokens,
                                    stop_tokens=self.stops, acceptor=self.acceptor, planner=self.planner,
                                    proposer=self.proposer,
                                    lookup=self.lookup, **options)

    # -- the passes ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Pass]:
        tic = time.perf_counter()
        for cycle in self._cycles:
            if cycle.is_prefill:
                self.prefill_seconds = time.perf_counter() - tic
                self.started = time.perf_counter()
            else:
                self._record(cycle.accepted, cycle.width, cycle.source)
            self.tokens_generated += len(cycle.tokens)
            finish = cycle.finish_reason  # the pass step's: a stop token, or max_tokens reached
            self.finish_reason = finish
            cycle.segments = self._segments(cycle.tokens, finish)
            yield cycle
            if finish:
                break
        self._end()

    def close(self) -> None:
        """Stop early: a queued verify pass is rolled out of the caches at once (they hold the committed tokens)."""
        self._cycles.close()
        self._end()

    def _end(self) -> None:
        self._warn()
        if self.memory is not None:
            self.memory.keep(self.planner)
            self.memory = None  # once per generation

    def _warn(self) -> None:
        if self.collapse_warning and not self._warned:
            self._warned = True
            logger.warning(self.collapse_warning)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    def _record(self, accepted: int, width: int, source: str) -> None:
        self.stats.record(accepted, width, source)
        self.drafted += width - 1
        self.accepted += accepted
        message = self.watch.check(self.stats) if self.watch else None
        if message:
            self.collapse_warning = message  # logged when the generation ends: see `_warn`

    def _segments(self, tokens: List[int], finish: Optional[str]) -> List[str]:
        if self._detokenizer is None:
            return []
        segments = []
        with self._lock:
            for i, token in enumerate(tokens):
                last = finish is not None and i == len(tokens) - 1
                if not (last and finish == "stop"):
                    self._detokenizer.add_token(token)
                if last:
                    self._detokenizer.finalize()
                segments.append(self._detokenizer.last_segment)
        return segments

    @property
    def prompt_tps(self) -> float:
        return self.prompt.size / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def generation_seconds(self) -> float:
        return time.perf_counter() - self.started if self.started else 0.0


def _lookup_index(state: Optional[DecodeState], history: Optional[Sequence[int]]) -> LookupIndex:
    """The conversation's lookup index: the one a continued `state` carries (a chat's earlier turns), else one built
    from `history` (a server's cached prefix); the loop extends it with the prompt and the committed tokens."""
    index = state.extra.get("lookup") if state is not None else None
    if index is None or (history is not None and len(history) and len(index) != len(history)):
        index = LookupIndex()
        if history is not None:
            index.extend(int(t) for t in history)
        if state is not None:
            state.extra["lookup"] = index
    return index


def _acceptor(sampling: dict) -> Acceptor:
    try:
        return make_acceptor(**sampling)
    except TypeError as e:  # an unknown keyword
        raise DFlashError(f"stream_generate: {e}; the sampling options are those of make_acceptor") from e
