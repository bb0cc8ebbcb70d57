"""The target side of DFlash: an mlx-lm model run layer by layer so the drafter can read its hidden states.

`TargetModel` never replaces or patches the user's layers. It walks `model.layers` itself (exactly as the model's
own `__call__` does, per `families.py`) and keeps the outputs of the tapped layers. `probe_parity` proves at load
time that this walk reproduces the model's own logits, and that a rolled-back cache continues like a fresh one.

Rollback: `make_cache` gives every layer a cache whose `trim(n)` drops the newest n tokens exactly: mlx-lm's
`KVCache` for full attention, `WindowKVCache` (rotating.py) for sliding-window layers, `GatedDeltaCache`
(hybrid.py) for GatedDeltaNet layers.

Quantized targets on Metal: only inside the target's own passes are its `QuantizedLinear` layers routed through
the verify-width kernel (`VerifyQmmScope`); outside them, the model is the user's, untouched.

Other kinds of target (a pipeline stage) are built by the code that made such models (`dflash_mlx.distributed`),
which hands them over ready, or installs their class (`register_target_class`) for `build_target` to use; the core
imports nothing of them.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from ..errors import DFlashError
from ..metal.verify_qmm import VerifyQmmScope
from .families import Family, family_for, supported_model_types, text_lm
from .hybrid import GatedDeltaCache, RecurrentRollback, default_rollback
from .rotating import WindowKVCache
from .walk import Chain, Segment, run


def model_type_of(model: nn.Module) -> Optional[str]:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


def split_into_stages(model: nn.Module) -> bool:
    """Whether mlx-lm's `pipeline()` split this model into stages (then a plain walk would run one stage only)."""
    return getattr(getattr(text_lm(model), "model", None), "pipeline_size", 1) > 1


class TargetModel:
    """An mlx-lm causal LM plus the bookkeeping DFlash needs: tapped forward, rollback, embedding and head."""

    stage_aware = False  # whether this class runs one stage of a pipeline-parallel model

    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        """Whether `build_target` should use this class for `model` (for installed subclasses)."""
        return False

    def __init__(self, model: nn.Module, tap_layer_ids: Sequence[int] = (),
                 recurrent_rollback: Optional[RecurrentRollback] = None):
        model_type = model_type_of(model)
        family = family_for(model_type)
        if family is None:
            raise DFlashError(
                f"unsupported target architecture '{model_type}'; supported: {', '.join(supported_model_types())}"
            )
        self.model = model
        self.family: Family = family
        self.lm = text_lm(model)
        self.inner = family.inner(self.lm)
        self.recurrent_rollback = recurrent_rollback or default_rollback()
        # Quantized layers: verify-width rows through the kernel, during our passes only (a no-op off Metal).
        self.verify_qmm = VerifyQmmScope(self.lm)
        self.tap_layer_ids: List[int] = []
        self.set_taps(tap_layer_ids)

    # -- shape facts ---------------------------------------------------------------------------------------
    @property
    def layers(self) -> List[nn.Module]:
        """The layers this target's walk runs (`walk.walk`): all of them (a pipeline stage: its own)."""
        return self.inner.layers

    @property
    def first_layer(self) -> int:
        """The global id of `layers[0]` (a pipeline stage's first layer is not the model's)."""
        return 0

    @property
    def decoder(self) -> nn.Module:
        """The decoder the family's mask builders see: one whose `layers` are `layers`."""
        return self.inner

    def receive(self, h: mx.array) -> mx.array:
        """The hidden state [1, N, H] the first of `layers` takes, given the embedded tokens (a pipeline stage
        receives the stage before's output instead)."""
        return h

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

    def check_taps(self, tap_layer_ids: Sequence[int]) -> None:
        """Raise one clear error when a layer id is out of range; changes nothing."""
        bad = [i for i in tap_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"drafter taps target layers {list(tap_layer_ids)} but the target has {self.num_layers} layers "
                f"(valid ids 0..{self.num_layers - 1}); the drafter was made for a different target"
            )

    def set_taps(self, tap_layer_ids: Sequence[int]) -> None:
        self.check_taps(tap_layer_ids)
        self.tap_layer_ids = list(tap_layer_ids)

    def with_taps(self, tap_layer_ids: Sequence[int]) -> "TargetModel":
        """This target if it taps exactly these layers, else a copy that does (same class, model and rollback):
        a target someone holds keeps its taps."""
        if list(tap_layer_ids) == self.tap_layer_ids:
            return self
        other = copy.copy(self)
        other.set_taps(tap_layer_ids)
        return other

    def _check_whole(self) -> None:
        # A plain walk of one pipeline stage would run part of the model and skip the stages' send and receive.
        if not self.stage_aware and split_into_stages(self.model):
            raise DFlashError("this target is split into pipeline stages: build its target with "
                              "dflash_mlx.distributed.pipeline.make_target(model) (or dflash_mlx.distributed.load)")

    # -- forward ---------------------------------------------------------------------------------------------
    def make_cache(self) -> List[Any]:
        """The model's own caches, with the ones mlx-lm cannot trim swapped for rollback-capable subclasses."""
        self._check_whole()
        caches = []
        for c in make_prompt_cache(self.model):
            if type(c) is RotatingKVCache:
                c = WindowKVCache.like(c)
            elif type(c) is ArraysCache and self.family.gated_delta:
                c = GatedDeltaCache(self.recurrent_rollback)
            caches.append(c)
        return caches

    def embed(self, ids: mx.array) -> mx.array:
        """The target's input embedding, with its scale (Gemma's sqrt(hidden)) where the model applies one."""
        return self.family.embed(self.lm, self.inner, ids)

    def head(self, h: mx.array, softcap: bool = True) -> mx.array:
        """LM head, then the target's final logit soft-cap where it has one (Gemma 4) unless `softcap=False`.

        Final norm is not included: `h` must already be normed (the drafter applies its own norm).
        """
        with self.verify_qmm:  # a quantized LM head: the drafter's block rows take the kernel too
            logits = self.family.head(self.lm, self.inner, h)
        cap = self.final_logit_softcapping
        if softcap and cap:
            logits = mx.tanh(logits / cap) * cap  # bit-identical to mlx-lm's compiled logit_softcap
        return logits

    @property
    def final_logit_softcapping(self) -> Optional[float]:
        """The soft-cap `head` applies (None if the target has none)."""
        return getattr(self.lm, "final_logit_softcapping", None)

    def __call__(self, ids: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        """Logits [1, T, V] and tapped features [1, T, n*H] (output of decoder layer k for each tapped k)."""
        with self.verify_qmm:
            return self.forward(ids, cache)

    def forward(self, ids: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        """`__call__`'s pass itself (a subclass's may do more around the walk; the call wraps it in the kernel
        scope)."""
        self._check_whole()
        (logits,), (hidden,) = run(self, [Chain(ids, cache)])
        return logits, hidden

    def forward_segments(self, segments: Sequence[Segment]) -> Tuple[List[mx.array], List[mx.array]]:
        """One pass over several requests' segments (`walk.Chain`, `walk.Tree`): each one's logits [1, w, V] and
        tapped features [1, w, n*H]. A subclass whose pass does more than the walk (a pipeline stage sends, and
        gathers the last stage's output) runs each chain through its own call instead (trees are never given to
        it: `tree.tree_support`)."""
        if type(self).forward is not TargetModel.forward:
            outs = [self(s.ids, s.cache) for s in segments]
            return [o[0] for o in outs], [o[1] for o in outs]
        self._check_whole()
        with self.verify_qmm:
            return run(self, segments)

    def rollback(self, cache: List[Any], num_tokens: int) -> None:
        """Drop the last `num_tokens` positions from every layer's cache (nothing to do on a full accept).

        Only tokens of the newest write (the last verify block) can be dropped.
        """
        if num_tokens <= 0:
            return
        for c in cache:
            c.trim(num_tokens)

    def check_rollback_supported(self, cache: List[Any]) -> None:
        # mlx-lm's RotatingKVCache claims to be trimmable until its window fills, then silently cannot be.
        stuck = sorted({type(c).__name__ for c in cache if type(c) is RotatingKVCache or not c.is_trimmable()})
        if stuck:
            raise DFlashError(
                f"target cache types {stuck} cannot be rolled back; build the cache with TargetModel.make_cache()"
                + ("" if self.family.gated_delta or "ArraysCache" not in stuck else
                   " (recurrent layers of this architecture are not supported)")
            )

    # -- load-time check -------------------------------------------------------------------------------------
    def probe_parity(self, num_tokens: int = 8, verify_tokens: int = 4, keep: int = 2) -> float:
        """Check our tapped walk against the model's own call (on mlx-lm's own caches); they must agree.

        Same-shape checks, tight: a cached prefill and a verify block. Then the block is rolled back to its first
        `keep` tokens and a one-token step is compared with the model fed only those tokens; that comparison
        crosses batch shapes (which may round differently on quantized targets), so it only has to be close: a
        wrong rollback moves logits by about their own scale. Returns the largest same-shape logit difference.
        """
        vocab = self.vocab_size
        n, v = num_tokens, verify_tokens
        ids = (mx.arange(n + v) * 7919 + 11) % vocab
        ids = ids[None].astype(mx.int32)
        ours_cache, theirs_cache = self.make_cache(), make_prompt_cache(self.model)
        worst = 0.0

        def compare(ours: mx.array, theirs: mx.array, what: str, tolerance: float = 1e-3) -> float:
            ours, theirs = ours.astype(mx.float32), theirs.astype(mx.float32)
            diff = mx.abs(ours - theirs).max().item()
            scale = max(1.0, mx.abs(theirs).max().item())
            if not diff <= tolerance * scale:
                raise DFlashError(
                    f"target '{self.family.name}' parity probe failed ({what}): our layer walk differs from the "
                    f"model's own logits by {diff:.3g}; this mlx-lm version or architecture variant is not supported"
                )
            return diff

        prefix = ids[:, :n]
        worst = compare(self(prefix, ours_cache)[0], self.model(prefix, cache=theirs_cache), "prefill")
        block = ids[:, n : n + v]
        worst = max(worst, compare(self(block, ours_cache)[0], self.model(block, cache=theirs_cache), "verify"))
        self.rollback(ours_cache, v - keep)
        fresh = make_prompt_cache(self.model)
        self.model(prefix, cache=fresh)
        self.model(block[:, :keep], cache=fresh)
        step = ids[:, n + keep : n + keep + 1]
        compare(self(step, ours_cache)[0], self.model(step, cache=fresh), "step after rollback", tolerance=5e-2)
        return worst


# Target classes other subsystems install for models they made (`register_target_class`), asked in order.
_classes: List[type] = []


def register_target_class(cls: type) -> None:
    """Have `build_target` use `cls` (a `TargetModel` subclass) for every model `cls.claims(model)` is true of,
    e.g. a pipeline stage's target. Installing the same class twice keeps one."""
    if cls not in _classes:
        _classes.append(cls)


def target_class(model: nn.Module) -> type:
    """The class `build_target` uses for `model`: an installed class that claims it, else `TargetModel`."""
    return next((cls for cls in _classes if cls.claims(model)), TargetModel)


def build_target(model: nn.Module, tap_layer_ids: Sequence[int] = (), **kwargs: Any) -> TargetModel:
    """The target for `model`, of the class `target_class` names."""
    return target_class(model)(model, tap_layer_ids, **kwargs)
