"""The target side of DFlash: an mlx-lm model run layer by layer so the drafter can read its hidden states.

`TargetModel` never replaces or patches the user's layers. It walks `model.layers` itself (exactly as the model's
own `__call__` does, per `families.py`) and keeps the outputs of the tapped layers. `probe_parity` proves at load
time that this walk reproduces the model's own logits.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import DFlashError
from .families import Family, family_for, supported_model_types


def model_type_of(model: nn.Module) -> Optional[str]:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


class TargetModel:
    """An mlx-lm causal LM plus the bookkeeping DFlash needs: tapped forward, rollback, embedding and head."""

    def __init__(self, model: nn.Module, tap_layer_ids: Sequence[int] = ()):
        model_type = model_type_of(model)
        family = family_for(model_type)
        if family is None:
            raise DFlashError(
                f"unsupported target architecture '{model_type}'; supported: {', '.join(supported_model_types())}"
            )
        self.model = model
        self.family: Family = family
        self.inner = family.inner(model)
        self.tap_layer_ids: List[int] = []
        self.set_taps(tap_layer_ids)

    # -- shape facts ---------------------------------------------------------------------------------------
    @property
    def layers(self) -> List[nn.Module]:
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        # Shapes are known without evaluating anything; this works for quantized embeddings too.
        return int(self.embed(mx.zeros((1, 1), dtype=mx.int32)).shape[-1])

    @property
    def vocab_size(self) -> int:
        return int(self.inner.embed_tokens.weight.shape[0])

    def set_taps(self, tap_layer_ids: Sequence[int]) -> None:
        bad = [i for i in tap_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"drafter taps target layers {list(tap_layer_ids)} but the target has {self.num_layers} layers "
                f"(valid ids 0..{self.num_layers - 1}); the drafter was made for a different target"
            )
        self.tap_layer_ids = list(tap_layer_ids)

    # -- forward ---------------------------------------------------------------------------------------------
    def make_cache(self) -> List[Any]:
        return make_prompt_cache(self.model)

    def embed(self, ids: mx.array) -> mx.array:
        return self.family.embed(self.model, self.inner, ids)

    def head(self, h: mx.array) -> mx.array:
        """Final norm is not included: `h` must already be normed (the drafter applies its own norm)."""
        return self.family.head(self.model, self.inner, h)

    def __call__(self, ids: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        """Logits [1, T, V] and tapped features [1, T, n*H] (output of decoder layer k for each tapped k)."""
        h = self.embed(ids)
        if cache is None:
            cache = [None] * self.num_layers
        masks = self.family.layer_masks(self.inner, h, cache)
        taps = {}
        wanted = set(self.tap_layer_ids)
        for i, (layer, mask, c) in enumerate(zip(self.inner.layers, masks, cache)):
            h = self.family.call_layer(layer, h, mask, c)
            if i in wanted:
                taps[i] = h
        logits = self.head(self.inner.norm(h))
        feats = [taps[i] for i in self.tap_layer_ids]
        hidden = mx.concatenate(feats, axis=-1) if len(feats) > 1 else (feats[0] if feats else h[..., :0])
        return logits, hidden

    def rollback(self, cache: List[Any], num_tokens: int) -> None:
        """Drop the last `num_tokens` positions from every layer's cache."""
        if num_tokens <= 0:
            return
        for c in cache:
            c.trim(num_tokens)

    def check_rollback_supported(self, cache: List[Any]) -> None:
        stuck = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        if stuck:
            raise DFlashError(f"target cache types {stuck} cannot be rolled back; this target is not supported yet")

    # -- load-time check -------------------------------------------------------------------------------------
    def probe_parity(self, num_tokens: int = 8) -> float:
        """Run a short prompt through the model's own call and through our tapped walk; they must agree.

        Checks a cached prefill and a one-token decode step. Returns the largest absolute logit difference.
        """
        vocab = self.vocab_size
        ids = (mx.arange(num_tokens + 1) * 7919 + 11) % vocab
        ids = ids[None].astype(mx.int32)
        ours_cache, theirs_cache = self.make_cache(), self.make_cache()
        worst = 0.0
        for chunk in (ids[:, :num_tokens], ids[:, num_tokens:]):
            ours, _ = self(chunk, ours_cache)
            theirs = self.model(chunk, cache=theirs_cache)
            ours, theirs = ours.astype(mx.float32), theirs.astype(mx.float32)
            diff = mx.abs(ours - theirs).max().item()
            scale = max(1.0, mx.abs(theirs).max().item())
            worst = max(worst, diff)
            if not diff <= 1e-3 * scale:
                raise DFlashError(
                    f"target '{self.family.name}' parity probe failed: our layer walk differs from the model's own "
                    f"logits by {diff:.3g}; this mlx-lm version or architecture variant is not supported"
                )
        return worst
