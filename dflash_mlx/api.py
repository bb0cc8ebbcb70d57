"""The Python API, shaped like mlx-lm's: `load`, `stream_generate` (one response per token), `generate`.

    from dflash_mlx import load, stream_generate
    model, tokenizer, drafter = load("path/or/repo-of-target", drafter="path/or/repo-of-drafter")
    for r in stream_generate(model, tokenizer, "Hello", drafter=drafter, max_tokens=64):
        print(r.text, end="")

Responses are mlx-lm `GenerationResponse`s plus the acceptance statistics of the verify pass each token came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .decode.acceptance import Acceptor
from .decode.generation import Generation
from .decode.lookup import LOOKUP_ONLY, drafter_model
from .decode.budget import DEFAULT_TREES
from .decode.memory import PlannerMemory
from .decode.planner import Planner, check_width
from .decode.state import DecodeState
from .decode.stats import AcceptanceStats
from .drafters.dflash import DFlashDrafter
from .errors import DFlashError
from .models.loading import load, prepare

__all__ = ["DFlashResponse", "generate", "load", "prepare", "print_stats", "stream_generate"]


@dataclass
class DFlashResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse` plus DFlash statistics.

    Args (beyond mlx-lm's):
        accepted (int): draft tokens accepted by the verify pass this token came from.
        width (int): tokens that pass verified (its verify width; 1 = a plain decoding step).
        tau (float): acceptance length so far (mean tokens committed per verify pass).
        widths (dict): verify width -> passes so far (the widths the engine used).
        stats (AcceptanceStats): the running statistics object (histograms included).
        source (str): where that pass's drafts came from: "dflash" (the drafter), "mtp" (the target's MTP layers),
            "lookup" (copied from the context), a proposer of your own by its name, or "plain" (none).
    """

    accepted: int = 0
    width: int = 1
    tau: float = 0.0
    widths: Optional[dict] = None
    stats: Optional[AcceptanceStats] = None
    source: str = "plain"


def _encode(tokenizer: TokenizerWrapper, prompt: Union[str, mx.array, List[int]]) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        # Same rule as mlx-lm: add special tokens unless the text already starts with BOS.
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    if len(prompt) == 0:
        raise DFlashError("the prompt is empty")
    return mx.array(prompt, dtype=mx.int32)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    drafter: Union[DFlashDrafter, str, None] = None,
    *,
    max_tokens: int = 256,
    width: Optional[int] = None,
    prefill_step_size: int = 2048,
    state: Optional[DecodeState] = None,
    acceptor: Optional[Acceptor] = None,
    planner: Optional[Planner] = None,
    warn_collapse: bool = True,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    lookup: Optional[bool] = None,
    proposer=None,
    tree_budget: Union[int, str, None] = DEFAULT_TREES,
    memory: Optional[PlannerMemory] = None,
    **sampling,
) -> Generator[DFlashResponse, None, None]:
    """Generate text with DFlash, one response per token.

    Args:
        model: the target (plain mlx-lm model, as returned by `load`).
        tokenizer: its tokenizer (a `TokenizerWrapper` or a Hugging Face tokenizer).
        prompt: text (encoded as mlx-lm does, no chat template applied) or token ids.
        drafter: the DFlash drafter; `None` decodes plainly through the same loop; "lookup" drafts only by copying
            from the context (any mlx-lm model, no drafter needed).
        max_tokens: the most tokens to generate (-1: until EOS).
        width: fixes the tokens verified per pass (1 means plain decoding). By default the width is chosen
            before every pass (`decode.planner.Planner`: expected committed tokens per second, from measured pass
            times and the acceptance so far), up to the drafter's block size; when sampling with a `seed`, from a
            fixed cost model instead of measured times, so that the seed reproduces the output.
        prefill_step_size: prompt tokens per prefill chunk.
        state: caches to continue from (see `decode.state.DecodeState`); fresh ones if omitted.
        acceptor: a ready acceptance rule (see `decode.acceptance.make_acceptor`), instead of the sampling keywords.
        planner: a ready planner (`decode.planner.Planner`, or a width policy such as `decode.width.WidthPolicy`)
            instead of the default one; ignored with `width`.
        prefill_progress: called as `(tokens_done, total)` after each prefill chunk (e.g. a progress bar).
        lookup: draft from the context too: each pass copies what followed the longest earlier match of the newest
            tokens (prompt, earlier turns in `state`, committed tokens) when that is expected to be faster than the
            drafter (see `decode.sources.SourceChoice`). Default: on with a drafter and a chosen width; False turns
            it off.
        warn_collapse: log one warning (logger "dflash_mlx") when drafts are almost never accepted for many passes.
        proposer: a drafting method of your own for passes wider than 1, in the drafter's place
            (`decode.proposers.Proposer`; see docs/python-api.md).
        tree_budget: each drafting pass verifies a draft tree of up to this many nodes in one target pass (DDTree:
            the drafter's likeliest continuations, several per position where it is unsure); "auto": the planner
            chooses chain or tree budget by measured speed; None: chains. Default: "auto", chains with a fixed
            `width` or a `seed` (the same seed then gives the same text in every front end). Lossless either way.
        memory: a `decode.memory.PlannerMemory` shared by several generations (a chat's turns): the planner starts
            from what the earlier ones measured (pass costs, acceptance, tree budgets) instead of probing afresh.
        sampling: the keywords of `decode.acceptance.make_acceptor`, as in mlx-lm:
            temp, top_p, top_k, min_p, min_tokens_to_keep (temp 0: greedy); sampled output is distributed
            exactly as sampling the target alone (rejection sampling);
            seed (makes sampled output reproducible);
            repetition_penalty, repetition_context_size (as in mlx-lm's `make_logits_processors`);
            logits_processors: mlx-lm logits processors `(tokens, logits) -> logits`; they see the prompt and
            the tokens before each position, exactly as in mlx-lm;
            sampler: an mlx-lm sampler object instead of temp/top_p/top_k/min_p (lossless, lower acceptance).

    Yields:
        DFlashResponse: text segment, token, logprobs, from_draft, timing, memory, finish_reason and
        acceptance statistics. The last response has `finish_reason` "stop" (EOS) or "length".
    """
    check_width(width, "stream_generate")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _encode(tokenizer, prompt)
    if isinstance(drafter, str):
        named, (drafter, lookup_only) = drafter, drafter_model(drafter)
        if not lookup_only:
            raise DFlashError(f"drafter={named!r}: give a loaded drafter (see load), None, or {LOOKUP_ONLY!r}")
        lookup = lookup is not False
    generation = Generation(prepare(model, drafter), drafter, ids, tokenizer=tokenizer, max_tokens=max_tokens,
                            width=width, planner=planner, acceptor=acceptor, state=state,
                            warn_collapse=warn_collapse, prefill_step_size=prefill_step_size,
                            prefill_progress=prefill_progress, lookup=lookup, proposer=proposer,
                            tree_budget=tree_budget,
                            memory=memory, **sampling)
    # As mlx-lm: keep the weights wired in memory on Macs while generating (a no-op elsewhere).
    with wired_limit(model, [generation_stream]), generation:  # closing rolls a queued pass out of the caches
        yield from _responses(generation)


def _responses(generation: Generation) -> Generator[DFlashResponse, None, None]:
    n, prompt_tokens, stats = 0, generation.prompt.size, generation.stats
    for p in generation:
        for i, token in enumerate(p.tokens):
            n += 1
            row = p.logits[i]
            yield DFlashResponse(
                text=p.segments[i],
                token=token,
                logprobs=row - mx.logsumexp(row, keepdims=True),
                from_draft=i < p.accepted,
                prompt_tokens=prompt_tokens,
                prompt_tps=generation.prompt_tps,
                generation_tokens=n,
                generation_tps=n / max(generation.generation_seconds, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=p.finish_reason if i == len(p.tokens) - 1 else None,
                accepted=p.accepted,
                width=p.width,
                tau=stats.tau,
                widths=dict(stats.widths),
                stats=stats,
                source=p.source,
            )


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int]],
    drafter: Optional[DFlashDrafter] = None,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response. With `verbose`, stream the text and print speed and acceptance.

    Args:
        model, tokenizer, prompt, drafter: as in `stream_generate`.
        verbose: print tokens as they come, then tok/s, τ and the acceptance histogram.
        kwargs: passed to `stream_generate` (max_tokens, width, temp, top_p, top_k, min_p, seed, ...).
    """
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, drafter, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print_stats(response, block_label="widest")
    return text


def print_stats(response, block_label: str = "block size") -> None:
    """Speed, acceptance and memory of a run, as the CLI and `generate(verbose=True)` print them; `block_label`
    names the widest block (`generate` says "widest")."""
    print("=" * 10)
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
    stats = response.stats
    if stats and stats.cycles:
        print(f"Acceptance: tau {stats.tau:.2f} over {stats.cycles} verify passes "
              f"({block_label} {stats.max_block}); tokens committed per pass:")
        print(stats.format_histogram())
    print(f"Peak memory: {response.peak_memory:.3f} GB", flush=True)
