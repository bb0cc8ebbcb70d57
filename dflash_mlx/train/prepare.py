"""Stages 1 and 2 of a run: the data read and packed (optionally answered by the target), then the frozen target's
tapped features extracted once into the feature cache (`prepare_cache`); both resume where they stopped. The
cache's fingerprint names what built it, so a run never trains on features of other data or another target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

from ..errors import DFlashError
from .args import TrainArgs
from .outdir import claim_out, inside


def _fingerprint(args: TrainArgs, target_ref: str, taps: List[int], feature_dim: int) -> Dict:
    """Everything the cache's contents depend on: `FeatureCache.open` refuses a cache built with other values."""
    return dict(format=2, target=target_ref, taps=list(taps), feature_dim=feature_dim, seq_len=args.seq_len,
                topk=args.kl_topk, data=list(args.data), max_data_tokens=args.max_data_tokens,
                regenerate=args.regenerate, eval_prompts=args.eval_prompts, seed=args.seed)


def prepare_cache(args: TrainArgs, model, tokenizer, target, target_ref: str, taps: List[int], log,
                  writable: bool = True):
    """Open or build the feature cache and finish its extraction. Returns (cache, extraction stats or None).

    `writable=False` (a resume whose cache lies outside its --out, not given this time) refuses to build or extend
    it: a resume writes nowhere but its --out.
    """
    from .data import prepare_data
    from .features import FeatureCache

    feature_dim = len(taps) * target.hidden_size
    fingerprint = _fingerprint(args, target_ref, taps, feature_dim)
    cache = FeatureCache.open(args.cache_dir, fingerprint)
    if (cache is None or not cache.complete) and not writable:
        state = "missing" if cache is None else "incomplete"
        raise DFlashError(f"the run's feature cache '{args.cache_dir}' is {state} and lies outside --out, where a "
                          "resume does not write; pass --cache DIR to rebuild it")
    if cache is None:
        if not args.data:
            raise DFlashError(f"--data is required (no feature cache yet at {args.cache_dir})")
        data = prepare_data(tokenizer, args.data, seq_len=args.seq_len, max_tokens=args.max_data_tokens,
                            num_eval=args.eval_prompts, seed=args.seed, model=model, regenerate_tokens=args.regenerate,
                            batch_size=args.gen_batch, progress=args.progress)
        log(f"data: {data.summary['documents']} documents, {data.tokens.size} tokens in {data.tokens.shape[0]} rows "
            f"of {args.seq_len}, {data.summary['trainable_tokens']} trainable; {len(data.eval_prompts)} held out")
        if data.summary.get("generation"):
            g = data.summary["generation"]
            log(f"target answers: {g['tokens']} tokens in {g['seconds']:.0f} s ({g['tok_s']:.1f} tok/s, batches of "
                f"{args.gen_batch})")
        if inside(args.cache_dir, args.out):
            claim_out(Path(args.out))
        cache = FeatureCache.create(args.cache_dir, data, feature_dim=feature_dim, topk=args.kl_topk,
                                    fingerprint=fingerprint)
    stats = None
    if not cache.complete:
        target.set_taps(taps)
        stats = cache.extract(target, progress=args.progress)
        log(f"features: {stats['tokens']} tokens in {stats['seconds']:.1f} s "
            f"({stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tok/s)")
        meta = dict(cache.meta, extraction=stats)
        (cache.path / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        cache.meta = meta
    return cache, stats
