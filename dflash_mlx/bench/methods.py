"""The decoding methods the benchmark compares, each timed the same way on the same prompt.

(a) `PlainMethod`: mlx-lm's `generate_step`. (b) `SpeculativeMethod`: mlx-lm's `speculative_generate_step` with an
autoregressive draft model. (c) `DFlashMethod`: our engine with a DFlash drafter, at a fixed verify width or with
the width chosen every cycle (`adaptive`, the default of `generate`), drafting from the context too when `lookup`
(the default); with no drafter and `lookup`, lookup drafting alone. (d) the same with the `OracleDrafter` fed
(a)'s output: every block is accepted, the ceiling of the machinery.

Timing: every method first caches the prompt minus its last token (untimed), then decodes; decode time runs from
the call that feeds the last prompt token to the moment the last new token is known, so it covers exactly the N
new tokens (prefill excluded) for every method alike, however many tokens its first pass commits.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..decode.generation import Generation
from ..decode.state import DecodeState, prefill_alone
from ..decode.step import Pass
from ..drafters.oracle import OracleDrafter
from ..targets import TargetModel

PHASES = ("draft", "verify", "rollback", "host")
PREFILL_STEP = 2048

class PhaseProfiler:
    """Wall time per phase of a DFlash run, through the engine's `profiler` hook.

    The engine calls `mark(phase, *arrays)` at the end of each phase; the arrays are evaluated first, so the time
    since the previous mark is that phase's device and host work. Forcing these syncs makes the profiled run
    slower than an unprofiled one; the benchmark times them separately.
    """

    def __init__(self):
        self.seconds: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last: Optional[float] = None

    def mark(self, phase: str, *arrays) -> None:
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        if self._last is not None and phase in self.seconds:
            self.seconds[phase] += now - self._last
        self._last = now  # the "prefill" mark only starts the clock

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class RunResult:
    tokens: List[int]
    seconds: float  # decode time (prefill excluded)
    cycles: List[Tuple[int, int]] = field(default_factory=list)  # (accepted, block) per verify pass
    sources: List[str] = field(default_factory=list)  # draft source per verify pass, as `cycles`
    passes: int = 0  # target passes during the decode, verify passes or not
    peak_memory: int = 0  # bytes, mx.get_peak_memory over prefill + decode
    phases: Optional[Dict[str, float]] = None  # seconds per phase, profiled runs only


def _prefill_mlx_lm(model: nn.Module, cache: List, ids: Sequence[int]) -> None:
    for begin in range(0, len(ids), PREFILL_STEP):
        model(mx.array(ids[begin : begin + PREFILL_STEP], dtype=mx.int32)[None], cache=cache)
        mx.eval([c.state for c in cache])


class Method:
    """One decoding method; subclasses turn a prompt into a stream of verify passes (`decode.step.Pass`, the
    same result type for mlx-lm's loops as for ours)."""

    kind = ""

    def __init__(self, name: str, block: int = 1):
        self.name = name
        self.block = block  # tokens verified per target pass (1 for plain decoding)

    def start(self, ids: List[int], max_tokens: int, stops: Sequence[int], reference: Optional[List[int]],
              profiler: Optional[PhaseProfiler], seed: Optional[int]) -> Iterator[Pass]:
        raise NotImplementedError

    def run(self, ids: List[int], max_tokens: int, stops: Sequence[int] = (), reference: Optional[List[int]] = None,
            seed: Optional[int] = None, profile: bool = False) -> RunResult:
        """Decode `max_tokens` tokens after `ids` (fewer at a stop token) and time the decode."""
        mx.synchronize()
        mx.reset_peak_memory()
        if seed is not None:
            mx.random.seed(seed)
        profiler = PhaseProfiler() if profile else None
        stop_set = set(stops)
        tokens: List[int] = []
        cycles: List[Tuple[int, int]] = []
        sources: List[str] = []
        passes = 0
        chunks = self.start(ids, max_tokens, stops, reference, profiler, seed)
        tic = time.perf_counter()
        try:
            for p in chunks:
                tokens.extend(p.tokens)
                passes += 1
                if not p.is_prefill:  # DFlash's first token comes from the prompt, not from a verify pass
                    cycles.append((p.accepted, p.width))
                    sources.append(p.source)
                hit = next((i for i, t in enumerate(tokens) if t in stop_set), None)
                if hit is not None or len(tokens) >= max_tokens:
                    break
            seconds = time.perf_counter() - tic
        finally:
            close = getattr(chunks, "close", None)
            if close:
                close()
            mx.synchronize()  # work a generator queued ahead must not leak into the next method's time
        stop = next((i for i, t in enumerate(tokens) if t in stop_set), None)
        tokens = tokens[: stop + 1] if stop is not None else tokens[:max_tokens]
        return RunResult(tokens, seconds, cycles, sources, passes, mx.get_peak_memory(),
                         dict(profiler.seconds) if profiler else None)


class PlainMethod(Method):
    """(a) mlx-lm plain decoding: one target forward per token."""

    kind = "mlx-lm"

    def __init__(self, model: nn.Module, temp: float = 0.0, name: str = "mlx-lm"):
        super().__init__(name, 1)
        self.model, self.temp = model, temp

    def start(self, ids, max_tokens, stops, reference, profiler, seed):
        cache = make_prompt_cache(self.model)
        _prefill_mlx_lm(self.model, cache, ids[:-1])
        steps = generate_step(mx.array(ids[-1:], dtype=mx.int32), self.model, max_tokens=max_tokens,
                              sampler=make_sampler(temp=self.temp), prompt_cache=cache)
        return (Pass([int(token)], 0, 1) for token, _ in steps)


class SpeculativeMethod(Method):
    """(b) mlx-lm speculative decoding with an autoregressive draft model proposing `num_draft` tokens."""

    kind = "mlx-lm-spec"

    def __init__(self, model: nn.Module, draft_model: nn.Module, num_draft: int, temp: float = 0.0):
        super().__init__(f"mlx-lm spec k={num_draft}", num_draft + 1)
        self.model, self.draft_model, self.num_draft, self.temp = model, draft_model, num_draft, temp

    def start(self, ids, max_tokens, stops, reference, profiler, seed):
        target_cache, draft_cache = make_prompt_cache(self.model), make_prompt_cache(self.draft_model)
        _prefill_mlx_lm(self.model, target_cache, ids[:-1])
        _prefill_mlx_lm(self.draft_model, draft_cache, ids[:-1])
        steps = speculative_generate_step(
            mx.array(ids[-1:], dtype=mx.int32), self.model, self.draft_model, num_draft_tokens=self.num_draft,
            max_tokens=max_tokens, sampler=make_sampler(temp=self.temp), prompt_cache=target_cache + draft_cache)
        return self._passes(steps)

    def _passes(self, steps) -> Iterator[Pass]:
        # mlx-lm yields token by token, but a pass's tokens all become known at its one sync; each pass ends with
        # the target's own token (from_draft False) unless max_tokens cuts it short.
        tokens: List[int] = []
        try:
            for token, _, from_draft in steps:
                tokens.append(int(token))
                if not from_draft:
                    yield Pass(tokens, len(tokens) - 1, self.block)
                    tokens = []
            if tokens:
                yield Pass(tokens, len(tokens) - 1, self.block)
        finally:
            steps.close()


class DFlashMethod(Method):
    """(c) DFlash with a drafter, or (d) with the oracle drafter when `drafter` is None (without `lookup`).

    `adaptive`: the width is chosen every cycle, up to `block`; else every cycle verifies `block` tokens.
`tree_budget`: drafted blocks are verified as DDTree trees of up to that many nodes ("auto": chain or tree chosen
every pass by measured speed).
    `lookup` (adaptive only): drafts copied from the context compete with the drafter's every pass; with no drafter,
    lookup drafting alone (method "lookup").
    """

    def __init__(self, target: TargetModel, drafter, block: int, temp: float = 0.0,
                 mask_token_id: Optional[int] = None, adaptive: bool = False, label: Optional[str] = None,
                 lookup: bool = False, tree_budget=None):
        self.lookup = lookup and adaptive
        self.oracle = drafter is None and not self.lookup
        self.kind = "oracle" if self.oracle else "dflash"
        method = getattr(drafter, "drafts_with", None) or "dflash"  # "mtp": the target's own MTP layers
        label = label or ("oracle" if self.oracle else "lookup" if drafter is None
                          else f"{method}+lookup" if self.lookup else method)
        name = f"{label} adaptive" if adaptive else f"{label} B={block}"
        super().__init__(name if tree_budget is None else f"{name} tree={tree_budget}", block)
        self.target, self.drafter, self.temp = target, drafter, temp
        self.tree_budget = tree_budget
        self.mask_token_id = mask_token_id
        self.adaptive = adaptive

    def start(self, ids, max_tokens, stops, reference, profiler, seed):
        drafter = self.drafter
        if self.oracle:
            if reference is None:
                raise ValueError("the oracle drafter needs the reference output of plain decoding")
            drafter = OracleDrafter(list(ids) + list(reference), self.target.vocab_size, self.block,
                                    self.mask_token_id or 0)
        state = DecodeState.fresh(self.target, drafter)
        if len(ids) > 1:
            prefill_alone(self.target, drafter, mx.array(ids[:-1], dtype=mx.int32), state, PREFILL_STEP)
        # Rejection sampling when temp > 0; a seeded sampled run chooses its widths from acceptance alone, so the
        # seed reproduces it (the rule every front end gets from `Generation`).
        generation = Generation(self.target, drafter, ids[-1:], max_tokens=max_tokens,
                                width=None if self.adaptive else self.block, max_width=self.block, mask_token_id=self.mask_token_id,
                                stop_tokens=stops, state=state, warn_collapse=False, profiler=profiler,
                                temp=self.temp, seed=seed, lookup=self.lookup,
                                history=ids[:-1] if self.lookup else None, tree_budget=self.tree_budget)
        return self._passes(generation)

    @staticmethod
    def _passes(generation: Generation) -> Iterator[Pass]:
        with generation:
            yield from generation


def verify_costs(model: nn.Module, ids: Sequence[int], feed: Sequence[int], ks: Sequence[int],
                 repeats: int = 5) -> Dict[int, float]:
    """Median seconds of one target forward over k tokens at the context `ids`, for each k (rolled back after).

    The k values take turns within each repeat, so a change in the machine's load hits them alike.
    """
    cache = make_prompt_cache(model)
    _prefill_mlx_lm(model, cache, ids)
    ks = sorted(set(ks))
    feed = list(feed) or [int(ids[-1])]
    feed = (feed * (ks[-1] // len(feed) + 1))[: ks[-1]]
    times: Dict[int, List[float]] = {k: [] for k in ks}
    for r in range(repeats + 1):
        for k in ks:
            x = mx.array(feed[:k], dtype=mx.int32)[None]
            tic = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if r:  # the first round is a warm-up
                times[k].append(time.perf_counter() - tic)
            trim_prompt_cache(cache, k)
    return {k: statistics.median(t) for k, t in times.items()}


def draft_costs(target: TargetModel, drafter, ids: Sequence[int], widths: Sequence[int],
                repeats: int = 5) -> Dict[int, float]:
    """Median seconds of one greedy draft of a `w`-token block after the context `ids`, for each width w > 1.

    The draft cache holds the prompt's features, as it does when decoding starts; a draft leaves the cache
    unchanged, so the same context serves every repeat. The widths take turns within each repeat.
    """
    state = DecodeState.fresh(target, drafter)
    prefill_alone(target, drafter, mx.array(list(ids), dtype=mx.int32), state, PREFILL_STEP)
    mask = drafter.mask_token_id
    widths = sorted(w for w in set(widths) if w > 1)
    times: Dict[int, List[float]] = {w: [] for w in widths}
    for r in range(repeats + 1):
        for w in widths:
            block = mx.array([[int(ids[-1])] + [mask] * (w - 1)], dtype=mx.int32)
            tic = time.perf_counter()
            mx.eval(drafter.greedy_draft(block, state.draft_cache))
            if r:  # the first round is a warm-up
                times[w].append(time.perf_counter() - tic)
    return {w: statistics.median(t) for w, t in times.items()}
