"""Pipeline parallelism: each rank runs a contiguous stage of the target's layers (mlx-lm's `pipeline()`).

mlx-lm splits the layers in reverse: the last rank runs the first layers and rank 0 the last ones. A forward pass
receives the hidden state from the rank before, runs this stage, sends it on, and every rank gets rank 0's final
hidden state (an all-gather), so logits, acceptance and drafting agree everywhere. `PipelineTarget` runs its stage
through the package's one layer walk (`targets.walk`: this stage's layers, the first of them global layer
`start_idx`, on the hidden state received from the rank before), keeping the taps this stage owns, then sends and
gathers as the model's own call does. The core never builds one by itself: `make_target(model)` does, and
importing this module installs the class with the core (`register_target_class`), so `prepare(model, drafter)` on
a pipelined model gets a `PipelineTarget` too.

The tapped layers live on different ranks, and the drafter (on every rank) needs all of them, but only for
committed positions. So a stage returns its partial taps (zeros where another stage owns the tap) and
`FeatureExchange`, the drafter's wrapper, sums them across ranks when the engine hands over the committed rows:
rejected positions never travel.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..targets.adapter import TargetModel, register_target_class, split_into_stages
from ..targets.walk import Chain, walk


class _Stage:
    """The decoder seen by mask builders: this stage's layers, everything else the real decoder's."""

    def __init__(self, inner: nn.Module, layers: List[nn.Module]):
        self._inner = inner
        self.layers = layers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _after(cache: Any, sent: mx.array) -> None:
    """Make evaluating this cache perform the send too (as mlx-lm's pipelined models do)."""
    if cache is None:
        return
    if getattr(cache, "keys", None) is not None and not callable(cache.keys):
        cache.keys = mx.depends(cache.keys, sent)
    elif isinstance(getattr(cache, "cache", None), list) and cache[0] is not None:
        cache[0] = mx.depends(cache[0], sent)


class _EagerModel:
    """The model's own call, evaluated at once (output and caches), so its receive and send happen right there."""

    def __init__(self, model: nn.Module):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        out = self._model(ids, cache=cache)
        mx.eval(out, [c.state for c in cache or []])
        return out


class PipelineTarget(TargetModel):
    """A `TargetModel` for one pipeline stage (see `make_target`)."""

    stage_aware = True

    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        return split_into_stages(model)

    def probe_parity(self, *args, **kwargs) -> float:
        # The probe leaves some of the model's own passes lazy until a later comparison; evaluated together with
        # ours, their receives and sends could pair up across ranks in a different order.
        model, self.model = self.model, _EagerModel(self.model)
        try:
            return super().probe_parity(*args, **kwargs)
        finally:
            self.model = model

    @property
    def layers(self) -> List[nn.Module]:
        return self.inner.pipeline_layers

    @property
    def num_layers(self) -> int:
        # The whole model's depth (a stage's own `layers` list stops at its last layer).
        args = getattr(self.lm, "args", None)
        return int(getattr(args, "num_hidden_layers", None) or len(self.inner.layers))

    @property
    def rank(self) -> int:
        return self.inner.pipeline_rank

    @property
    def size(self) -> int:
        return self.inner.pipeline_size

    @property
    def first_layer(self) -> int:
        return self.inner.start_idx

    @property
    def decoder(self) -> nn.Module:
        return _Stage(self.inner, self.layers)

    def receive(self, h: mx.array) -> mx.array:
        # The last rank runs the first layers: it starts from the embedding.
        return mx.distributed.recv_like(h, self.rank + 1) if self.rank < self.size - 1 else h

    def forward(self, ids: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        """Logits [1, T, V] (the same on every rank) and this stage's partial taps [1, T, n*H]."""
        h, taps = walk(self, [Chain(ids, cache)])
        if self.rank != 0:
            h = mx.distributed.send(h, (self.rank - 1) % self.size)
            _after(cache[-1] if cache else None, h)
        h = mx.distributed.all_gather(h)[: h.shape[0]]  # rank 0's: the output of the last layer
        logits = self.head(self.inner.norm(h))
        feats = [taps[i] if i in taps else mx.zeros_like(h) for i in self.tap_layer_ids]
        partial = mx.concatenate(feats, axis=-1) if len(feats) > 1 else (feats[0] if feats else h[..., :0])
        # Evaluating the taps runs the whole stage chain first (send, all-gather), in the same order on every
        # rank: a rank that met the collectives in another order would wait forever.
        partial = mx.depends(partial, h)
        return logits, partial


def make_target(model: nn.Module, tap_layer_ids: Sequence[int] = (), **kwargs: Any) -> TargetModel:
    """The target for `model`: a `PipelineTarget` for a model split into stages, else a plain `TargetModel`.
    Hand it to `dflash_mlx.models.loading.prepare(target, drafter)`."""
    cls = PipelineTarget if PipelineTarget.claims(model) else TargetModel
    return cls(model, tap_layer_ids, **kwargs)


# The core builds plain targets only; this is how `build_target` (and so `prepare(model, drafter)`) builds a
# stage's.
register_target_class(PipelineTarget)


class FeatureExchange:
    """The drafter of a pipelined target: sums the stages' partial taps across ranks before drafting context.

    Everything else is the wrapped drafter's (config, block size, caches, drafting).
    """

    def __init__(self, drafter, group: Optional[mx.distributed.Group] = None):
        self.drafter = drafter
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)

    def __call__(self, block_ids: mx.array, cache) -> mx.array:
        return self.drafter(block_ids, cache)

    def append_context(self, partial: mx.array, cache) -> None:
        """partial: [1, S, n*H] taps of S committed positions, zero where another stage owns the tap."""
        whole = mx.distributed.all_sum(partial, group=self.group)
        # Settle the exchange now, so the next verify pass (its own receive and send) cannot be scheduled
        # around it differently on different ranks.
        mx.eval(whole)
        self.drafter.append_context(whole, cache)
