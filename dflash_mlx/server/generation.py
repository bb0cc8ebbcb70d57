"""The server's one door into the DFlash engine: run a tokenized request with the prefix cache, cycle by cycle.

`Generator.run` restores the longest cached prefix of the prompt, prefills the rest (stopping at message boundaries
to snapshot caches that cannot be cut back), then drives a `generation.Generation` and yields one `Delta` per
verify pass and a final `Outcome`. Between two passes it polls `should_stop`; closing the engine's generator rolls
a queued pass out of the caches, so they hold exactly the committed tokens and are stored for the next request.
With `max_batch` > 1, `run(..., batched=True)` generations share their verify passes (`batching.Batch`): the worker
advances several runs in turn, one pass each, and each reply is what it would be alone.
Everything here runs on the server's single worker thread (MLX is driven from one thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Union

import mlx.core as mx

from ..decode.batching import Batch, BatchedGeneration
from ..decode.budget import DEFAULT_TREES
from ..decode.generation import Generation
from ..decode.lookup import drafter_model
from ..decode.memory import PlannerMemory
from ..decode.state import DecodeState, prefill_alone
from ..decode.stats import AcceptanceStats
from ..models.loading import prepare
from ..targets.caches import can_trim
from .prefix_cache import Hit, PrefixCache, Snapshot
from .prefix_store import PrefixStore
from .text import StopMatcher
from .tokenizer_lock import tokenizer_lock

logger = logging.getLogger("dflash_mlx")


@dataclass
class GenerationRequest:
    """A tokenized request. `boundaries` are prompt positions (message ends) worth a snapshot."""

    prompt: List[int]
    max_tokens: int
    boundaries: List[int] = field(default_factory=list)
    sampling: Dict = field(default_factory=dict)  # temp, top_p, top_k, min_p, seed, repetition_penalty
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: List[tuple]  # (token id, logprob), most likely first


@dataclass
class Delta:
    """The text one verify pass added (after stop-string handling), its tokens and their log-probabilities."""

    text: str
    tokens: List[int]
    logprobs: Optional[List[TokenLogprob]] = None
    cached_tokens: int = 0  # of the prompt, read from the prefix cache
    # Where each token came from ("drafter", "lookup" or "target": a pass's accepted drafts, then the target's
    # own token) and the text each token added before stop-string handling; the chat page marks tokens with them.
    origins: List[str] = field(default_factory=list)
    segments: List[str] = field(default_factory=list)


def origins(p) -> List[str]:
    """The origin of each token a pass committed: its accepted drafts ("lookup" copies, else the drafter's: DFlash,
    MTP or a caller's own proposer), then the target's own token (a plain pass accepts no draft)."""
    drafted = "lookup" if p.source == "lookup" else "drafter"
    return [drafted if i < p.accepted else "target" for i in range(len(p.tokens))]


@dataclass
class PrefillProgress:
    """A prompt chunk is done (`done` of `total` tokens): the worker may run other requests' passes now. It is not
    handed to the client."""

    done: int
    total: int


@dataclass
class Outcome:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    stats: Dict
    stop_string: Optional[str] = None


def _dflash_stats(stats: AcceptanceStats, widths: Dict[int, int], drafted: int, accepted: int, plain: bool,
                  ttft: float, gen_time: float, n: int, prefilled: int, prefill_time: float) -> Dict:
    return {
        "tau": round(stats.tau, 4),
        "cycles": stats.cycles,
        "verify_widths": {str(k): v for k, v in sorted(widths.items())},
        "acceptance_histogram": {str(k): v for k, v in sorted(stats.histogram.items())},
        "sources": stats.source_counts(),  # draft source ("dflash", "lookup", "plain") -> passes, tokens
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        # Plain decoding: no drafter, block size 1, or every pass verified a single token.
        "fallback": plain or (stats.cycles > 0 and drafted == 0),
        "prefilled_tokens": prefilled,
        "time_to_first_token_s": round(ttft, 6),
        "prompt_tps": round(prefilled / prefill_time, 3) if prefill_time > 0 else 0.0,
        "generation_tps": round(n / gen_time, 3) if gen_time > 0 else 0.0,
    }


def cancelled_outcome(prompt_tokens: int, emitted: int, cached: int = 0, prefilled: int = 0, plain: bool = False,
                      prefill_time: float = 0.0) -> Outcome:
    """The Outcome of a request stopped before its end (client gone, server stopping), with empty statistics."""
    summary = _dflash_stats(AcceptanceStats(), {}, 0, 0, plain, 0.0, 0.0, 0, prefilled, prefill_time)
    summary.update(plain_passes=0, collapsed=False)
    return Outcome("cancelled", prompt_tokens, emitted, cached, prefilled, summary)


class Generator:
    """One loaded target/drafter pair, its tokenizer and the prefix cache."""

    def __init__(self, model, tokenizer, drafter, *, width: Optional[int] = None,
                 prompt_cache_bytes: int = 2 << 30, prefill_step_size: int = 2048, max_batch: int = 1,
                 store: Optional[PrefixStore] = None, tree_budget: Union[int, str, None] = DEFAULT_TREES,
                 lookup: Optional[bool] = None):
        # `--draft lookup`: no drafter; every pass may copy from the context (the prompt, cached prefixes).
        drafter, self.lookup_only = drafter_model(drafter)
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.width = width  # a fixed verify width (None: chosen each pass)
        self.tree_budget = tree_budget  # drafted blocks as trees: DEFAULT_TREES resolves per request
        self.lookup = lookup  # drafts copied from the context: None = the engine's default, False = never
        self.collapse_logged = False  # the acceptance-collapse warning: the first one only (agents send hundreds)
        # What this process has measured (seconds per width and tree budget, acceptance per source) seeds every
        # request's planner, so a short reply does not pay the probes a cold planner makes.
        self.memory = PlannerMemory()
        self.prefill_step_size = prefill_step_size
        self.target = prepare(model, drafter)
        # Up to `max_batch` runs share each verify pass (the worker interleaves them); 1: one run at a time.
        self.max_batch = max(1, int(max_batch))
        self.batch = Batch(self.target, drafter) if self.max_batch > 1 else None
        # MLX streams belong to threads: weights still lazy here would be evaluated on the worker thread against
        # this thread's stream, which fails. Materialize them now.
        mx.eval(model.parameters(), drafter.parameters() if drafter is not None else [])
        self.cache = PrefixCache(prompt_cache_bytes)
        # Entries the cache evicts, and all of them when the server stops, go to disk (`--prompt-cache-dir`).
        self.store = store
        if store is not None:
            self.cache.on_evict = store.save
        # Held while detokenizing: the HTTP handlers encode prompts with the same tokenizer on their own thread.
        self.tokenizer_lock = tokenizer_lock(tokenizer)
        caches = self.target.make_cache() + (drafter.make_cache() if drafter is not None else [])
        self.cuttable = all(can_trim(c) for c in caches)

    @property
    def plain(self) -> bool:
        if self.drafter is None:
            return not self.lookup_only or self.width is not None
        return (self.width or self.drafter.block_size) <= 1

    def _restore(self, hit: Hit) -> DecodeState:
        if hit.snapshot is None:
            return DecodeState.fresh(self.target, self.drafter)
        target, draft, pending = hit.snapshot.restore(hit.length)
        return DecodeState(target, draft, last_token=-1, pending_context=pending)

    def _lookup(self, prompt: List[int]) -> Hit:
        """The longest cached prefix of the prompt (at most all but its last token), in memory or on disk."""
        limit = len(prompt) - 1
        hit = self.cache.lookup(prompt, limit) if self.cache.max_bytes > 0 else Hit(None, 0)
        if self.store is not None:
            length, stored = self.store.best(prompt, limit)
            if length > hit.length:
                snapshot = self.store.load(stored)
                if snapshot is not None:
                    if self.cache.max_bytes > 0:
                        self.cache.insert(stored.key, snapshot)
                    hit = Hit(snapshot, length)
        return hit

    def persist(self, deadline: Optional[float] = None) -> None:
        """Write the cached entries the disk store lacks (the server is stopping), the most recently used first;
        none is started after `deadline` (time.monotonic()), so a stopping server exits in bounded time."""
        if self.store is None:
            return
        entries = [(key, snap) for key, snap in self.cache.items() if tuple(key) not in self.store.entries]
        for i, (key, snapshot) in enumerate(reversed(entries)):
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("stopping: %d prefix-cache entries (the least recently used) were not written to "
                               "--prompt-cache-dir in time", len(entries) - i)
                return
            self.store.save(key, snapshot)

    def _store(self, tokens: List[int], state: DecodeState) -> None:
        if self.cache.max_bytes <= 0 or not tokens:
            return
        self.cache.insert(tokens, Snapshot.take(state.target_cache, state.draft_cache, state.pending_context,
                                                len(tokens)))

    def _advance(self, state: DecodeState, tokens: List[int]) -> None:
        """Run `tokens` through the target and into the drafter's context without generating (a prefill that
        stops at a message boundary)."""
        prefill_alone(self.target, self.drafter, mx.array(tokens, dtype=mx.int32), state, self.prefill_step_size)

    def run(self, req: GenerationRequest, should_stop: Callable[[], bool] = lambda: False, batched: bool = False
            ) -> Iterator[Union[Delta, Outcome]]:
        """The request's Deltas, one per verify pass, then its Outcome. `batched`: its passes are shared with the
        other batched runs in progress (the caller advances them in turn)."""
        tic = time.perf_counter()
        prompt = list(req.prompt)
        n = len(prompt)
        hit = self._lookup(prompt)
        cached = hit.length
        state = self._restore(hit)
        position = cached
        if not self.cuttable:
            # Caches that cannot be cut back are snapshotted where a later request is likely to branch off.
            for b in sorted(set(req.boundaries)):
                if position < b < n:
                    self._advance(state, prompt[position:b])
                    position = b
                    self._store(prompt[:b], state)
        # A long prompt is prefilled here a chunk at a time, so a request whose client has gone stops between two
        # chunks; the chunks already done go into the prefix cache, and the client's identical retry resumes there.
        # The last chunk is the engine's own prefill. Between chunks the worker runs the other requests' passes.
        step = self.prefill_step_size
        while n - position > step:
            if should_stop():
                if position > cached:
                    self._store(prompt[:position], state)
                logger.info("prefill stopped after %d of %d prompt tokens (client gone or server stopping); kept for a retry",
                            position, n)
                yield cancelled_outcome(n, 0, cached, position - cached, self.plain, time.perf_counter() - tic)
                return
            self._advance(state, prompt[position : position + step])
            position += step
            yield PrefillProgress(position, n)

        options = dict(tokenizer=self.tokenizer, state=state, history=prompt[:position],
                       tokenizer_lock=self.tokenizer_lock, prefill_step_size=self.prefill_step_size,
                       memory=self.memory, log_collapse=False, **req.sampling)
        # The decode options go by name: the engine decides with them (`decode.planner.build_planner`).
        lookup = True if self.lookup_only else self.lookup
        if batched and self.batch is not None:
            generation = BatchedGeneration(self.batch, prompt[position:], max_tokens=req.max_tokens, width=self.width,
                                           lookup=lookup, tree_budget=self.tree_budget, **options)
        else:
            generation = Generation(self.target, self.drafter, prompt[position:], max_tokens=req.max_tokens,
                                    width=self.width, lookup=lookup, tree_budget=self.tree_budget, **options)
        widths: Dict[int, int] = {}
        last_width = 0
        committed: List[int] = []
        stopper = StopMatcher(req.stop)
        finish, emitted, ttft = None, 0, 0.0
        try:
            for p in generation:
                if p.is_prefill:
                    ttft = time.perf_counter() - tic
                    if not self.cuttable:
                        # The prompt's state, before any verify pass: the next turn of a chat extends this prompt.
                        self._store(prompt, state)
                else:
                    widths[p.width] = widths.get(p.width, 0) + 1
                    last_width = p.width
                committed.extend(p.tokens)
                text, tokens = "", []
                for i, (token, segment) in enumerate(zip(p.tokens, p.segments)):
                    emitted += 1
                    tokens.append(token)
                    # The engine ends the generation after a pass's last token: at a stop token or at max_tokens.
                    last = p.finish_reason is not None and i == len(p.tokens) - 1
                    text += stopper.feed(segment, final=last)
                    if stopper.hit is not None or last:
                        finish = "stop" if stopper.hit is not None else p.finish_reason
                        break
                logprobs = self._logprobs(p.logits, tokens, req.top_logprobs) if req.logprobs else None
                yield Delta(text, tokens, logprobs, cached, origins(p)[: len(tokens)], list(p.segments[: len(tokens)]))
                if finish is None and should_stop():
                    finish = "cancelled"
                if finish is not None:
                    break
            if finish is None:  # the engine ran out of tokens without saying why: treat as the length limit
                tail = stopper.feed("", final=True)
                if tail:
                    yield Delta(tail, [])
                finish = "length"
        except BaseException:
            generation.close()
            raise  # caches a failed pass may have half-written are never stored
        generation.close()  # rolls a queued verify pass out of the caches
        if committed and state.last_token == committed[-1]:
            self._store(prompt + committed[:-1], state)  # the newest token is not in the caches yet
        gen_time = generation.generation_seconds
        # Width-1 passes are plain decoding steps, except a last pass the token limit cut down.
        plain_passes = widths.get(1, 0) - (1 if last_width == 1 and emitted >= req.max_tokens else 0)
        summary = _dflash_stats(generation.stats, widths, generation.drafted, generation.accepted, self.plain, ttft,
                                gen_time, emitted, n - cached, ttft)
        summary["plain_passes"] = plain_passes
        summary["fallback"] = summary["fallback"] or plain_passes > 0
        # Drafting stopped paying off (tau near 1 over many passes): logged once per server, counted in /metrics.
        summary["collapsed"] = generation.collapse_warning is not None
        if summary["collapsed"] and not self.collapse_logged:
            self.collapse_logged = True
            logger.warning(f"{generation.collapse_warning} (logged once per server; /metrics counts every such "
                           "request as dflash_collapsed_generations_total)")
        yield Outcome(finish, n, emitted, cached, n - cached, summary, stopper.hit)

    def _logprobs(self, logits: mx.array, tokens: List[int], top: int) -> List[TokenLogprob]:
        rows = logits[: len(tokens)].astype(mx.float32)
        lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        ids = mx.array(tokens, dtype=mx.int32)[:, None]
        chosen = mx.take_along_axis(lp, ids, axis=-1)[:, 0]
        k = max(0, min(int(top), lp.shape[-1]))
        if k:
            order = mx.argsort(-lp, axis=-1)[:, :k]
            top_lp = mx.take_along_axis(lp, order, axis=-1)
            order, top_lp = order.tolist(), top_lp.tolist()
        chosen = chosen.tolist()
        return [TokenLogprob(t, chosen[i], list(zip(order[i], top_lp[i])) if k else [])
                for i, t in enumerate(tokens)]
