"""The frozen target of a training run: loading it (`load_training_target`), fingerprinting what it computes
(`target_identity`, saved with every checkpoint), and refusing a `--resume` whose --target is another model
(`check_resumed_target`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ..errors import DFlashError
from .args import TrainArgs


def load_training_target(ref: str):
    """(model, tokenizer, path) for a local mlx-lm dir, an offline or registry name, or a hub repo id.

    `models.loading.load_target` plus the resolved path, which the feature cache's fingerprint names."""
    from ..models.loading import load_target as load, resolve_target

    ref = resolve_target(ref)
    model, tokenizer = load(ref)
    return model, tokenizer, ref


def target_identity(model) -> str:
    """A fingerprint of what the target computes, wherever it is stored: its configuration and, for every weight,
    name, shape, dtype and a strided sample of its values. A copy matches; a fine-tune, another quantization or
    another size does not. Cheap: a few thousand values per tensor, never the whole weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    a = getattr(model, "args", None)
    config = dataclasses.asdict(a) if dataclasses.is_dataclass(a) else dict(vars(a)) if a is not None else {}
    # Values JSON cannot hold count by their type only: their repr may hold a memory address, unstable across runs.
    h.update(json.dumps(config, sort_keys=True, default=lambda o: type(o).__name__).encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        flat = p.reshape(-1)
        sample = flat[:: max(1, flat.size // 4096)][:4096]
        if sample.dtype == mx.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            sample = sample.astype(mx.float32)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(np.asarray(sample).tobytes())
    return h.hexdigest()


def _cache_target(cache_dir: Path) -> Optional[str]:
    """The target reference a feature cache's fingerprint names, if there is a cache."""
    file = Path(cache_dir) / "meta.json"
    try:
        return json.loads(file.read_text()).get("fingerprint", {}).get("target") if file.is_file() else None
    except (OSError, ValueError):
        return None


def check_resumed_target(saved: Dict, given: str, target, identity: str, args: TrainArgs, target_ref: str):
    """Refuse a --target that is not the model the checkpoint was trained on; returns the target reference to
    expect in the feature cache's fingerprint (the cache came from the same model, maybe at another path)."""
    saved_ref = saved["args"]["target"]
    stored = _cache_target(args.cache_dir)

    def other(why: str) -> DFlashError:
        return DFlashError(f"--target '{given}' is not the model this run was trained on ('{saved_ref}'): {why}; "
                           f"resume with --target {saved_ref} (or a copy of it), or start a new run in another --out")

    if saved.get("target_identity"):
        if saved["target_identity"] != identity:
            raise other("its configuration or weights differ")
    elif given != saved_ref and stored != target_ref:
        # A checkpoint from before target fingerprints: compare the target's features with the cached ones.
        from .features import FeatureCache
        import mlx.core as mx

        cache = FeatureCache.open(args.cache_dir)  # no fingerprint: the target's path is what differs
        if cache is None or cache.rows_done < 1:
            raise other("the run predates target fingerprints and has no feature cache to compare with")
        target.set_taps(list(args.target_layers))
        _, hidden = target(mx.array(np.asarray(cache.tokens[:1])))
        ours = np.asarray(hidden.astype(mx.float32))[0]
        theirs = np.asarray(cache.features()[0], dtype=np.float32)
        scale = max(1.0, float(np.abs(theirs).max()))
        if ours.shape != theirs.shape or not np.allclose(ours, theirs, rtol=2e-2, atol=2e-2 * scale):
            raise other("its features on the cached data differ")
    return stored or target_ref
