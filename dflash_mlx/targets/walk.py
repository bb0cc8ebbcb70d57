"""The layer walk: every target pass, whatever its shape, runs the decoder layers through `walk`.

A pass is a list of **segments**, each one request's block with its own caches:
- `Chain`: consecutive tokens after the cache's last position (a prefill chunk, a verify block); written to the
  caches as the model's own call writes them;
- `tree.Tree`: a draft tree's nodes (slot 0 the root, `parents[i] < i`), every node at its own position (the
  cache offset plus its depth) seeing the cached rows and its ancestors; the caches are only read, and what the
  pass computed is kept in a `TreeWrite` for `targets.tree.commit_path`.

The single stream's pass is one Chain; a tree verify is one Tree; a batch's pass is several of either (ragged: no
padding, any widths). The segments' tokens are laid end to end as one stream [1, N, H] for the embedding, the
final norm and the LM head. Per layer:
- one Chain: the layer runs whole on it, exactly the model's own call (on MLX's CPU backend a short chain, a verify
  block or a decode step, runs as several segments do, for `attention.attention`'s cheaper softmax);
- one Tree: a pre-norm block with plain attention runs as below (its nodes attend as one sequence of query rows
  under the ancestor mask, each at its own RoPE position); any other layer runs whole on its nodes as a batch of
  one-token sequences, with stand-in caches that give every node its position and mask;
- several segments, on a pre-norm block `h = x + mix(norm1(x)); h + mlp(norm2(h))` (`splittable`): the norms and
  the MLP run once on the whole stream and only the token mixer (attention, GatedDeltaNet) per segment; mlx-lm's
  plain attention (`plain_attention`) also projects q/k/v/o on the whole stream, and only RoPE, the cache and SDPA
  (`attention.attention`) run per segment (a decode step is memory-bound: the weights read once per pass, not once per request);
- several segments on any other layer: the layer runs whole per segment.

Family differences (embedding, masks, KV sharing and per-layer inputs) are hooks of `families.Family`, so this
loop is the package's only definition of a target's layer walk. A target walks its share of the layers
(`TargetModel.layers`, the first of them global layer `first_layer`): all of them, or one pipeline stage's
(`distributed.pipeline`), whose hidden state arrives from the stage before (`TargetModel.receive`) ahead of its
first layer. Caches, masks and a segment's per-layer state are indexed by the local layer index (a stage's caches
are its own layers'); taps and the family's per-layer inputs and KV sharing by the global layer id. The
GatedDeltaNet layers of hybrid targets run `hybrid.gated_delta_net` on a chain and `tree.gdn_tree` on a tree; both
record what a rollback or a commit needs.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from . import attention
from .hybrid import gated_delta_net
from .mlx_lm_contract import PLAIN_ATTENTION, PLAIN_ATTENTION_MODULES, PRE_NORM_LAYER, PRE_NORM_MODULES

def splittable(layer: nn.Module) -> bool:
    """Whether `layer` is a pre-norm block whose token mixer can run per segment and the rest on all tokens."""
    module = type(layer).__module__.rsplit(".", 1)[-1]
    mixer = "linear_attn" if getattr(layer, "is_linear", False) else "self_attn"
    return module in PRE_NORM_MODULES and mixer in layer and all(part in layer for part in PRE_NORM_LAYER)


def plain_attention(attn: nn.Module) -> bool:
    """Whether `attn` is mlx-lm's plain `Attention` of a module whose call the segments restate."""
    module = type(attn).__module__.rsplit(".", 1)[-1]
    return (type(attn).__name__ == "Attention" and module in PLAIN_ATTENTION_MODULES
            and all(hasattr(attn, a) for a in PLAIN_ATTENTION))


def _is_linear(layer: nn.Module) -> bool:
    return bool(getattr(layer, "is_linear", False))


class Segment:
    """One request's block in a pass: its ids [1, w] and its caches (see the module docstring). Its methods take
    the local layer index i, the index of layer i's cache."""

    # Whether a pre-norm layer runs on this segment through `_split` even when it is the pass's only segment: a
    # tree restates plain attention (`tree.Tree.attend`) so that its nodes attend as one sequence instead of as
    # one-token sequences that each read the whole cache; a chain does on the CPU path (`Chain.split_alone`).
    split_alone = False

    def __init__(self, ids: mx.array, cache: Optional[List[Any]]):
        self.ids, self.cache = ids, cache
        self.width = ids.shape[1]

    def begin(self, target, h: mx.array) -> None:
        """Set up the pass on this segment's embedded tokens h [1, w, H] (masks, per-layer state)."""

    def cache_at(self, i: int) -> Any:
        return self.cache[i] if self.cache is not None and i < len(self.cache) else None

    # The shapes a layer sees: a chain its tokens [1, w, H], a tree its nodes [w, 1, H].
    def view(self, x: mx.array) -> mx.array:
        return x

    def unview(self, x: mx.array) -> mx.array:
        return x

    def mask(self, i: int) -> Any:
        raise NotImplementedError

    def kv(self, i: int) -> Any:
        """What layer i's attention gets as its cache."""
        raise NotImplementedError

    def gdn(self, attn: nn.Module, i: int, x: mx.array) -> mx.array:
        """Layer i's GatedDeltaNet on this segment's normed input (in its view)."""
        raise NotImplementedError

    def attend(self, attn: nn.Module, i: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """mlx-lm's plain attention from projected q, k, v [1, w, heads*d] to the pre-`o_proj` output [1, w, D]."""
        raise NotImplementedError

    def finish(self) -> None:
        """The pass is over (a tree collects its write)."""


class Chain(Segment):
    """Consecutive tokens after the cache's last position, written to the caches (see the module docstring)."""

    @property
    def split_alone(self) -> bool:
        # On MLX's CPU backend a short pass attends through `attention.attention`, which only the restated plain
        # attention calls (`attend`); elsewhere a lone chain runs the model's own layer.
        return attention.on_cpu_path(self.width)

    def begin(self, target, h: mx.array) -> None:
        n = len(target.layers)
        cache = [None] * n if self.cache is None else list(self.cache) + [None] * (n - len(self.cache))
        self.masks = target.family.layer_masks(target.decoder, h, cache)

    def mask(self, i: int) -> Any:
        return self.masks[i]

    def kv(self, i: int) -> Any:
        return self.cache_at(i)

    def gdn(self, attn: nn.Module, i: int, x: mx.array) -> mx.array:
        return gated_delta_net(attn, x, self.masks[i], self.cache_at(i))

    def attend(self, attn, i, q, k, v):
        cache, n = self.cache_at(i), self.width
        queries = q.reshape(1, n, attn.n_heads, -1)
        keys = k.reshape(1, n, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # qwen3, qwen3_moe
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        values = v.reshape(1, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        queries, keys = attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = attention.attention(queries, keys, values, cache=cache, scale=attn.scale, mask=self.masks[i])
        return out.transpose(0, 2, 1, 3).reshape(1, n, -1)


# -- the walk ----------------------------------------------------------------------------------------------------
def _mix(layer: nn.Module, i: int, seg: Segment, x: mx.array) -> mx.array:
    """Layer i's token mixer on one segment's normed input (in the segment's view)."""
    if _is_linear(layer):
        return seg.gdn(layer.linear_attn, i, x)
    return layer.self_attn(x, seg.mask(i), seg.kv(i))


def _whole(family, inner, layer: nn.Module, i: int, g: int, seg: Segment, x: mx.array, extra: Dict) -> mx.array:
    """Layer i (global layer g) run whole on one segment's input [1, w, H]."""
    x = seg.view(x)
    if _is_linear(layer):  # a GatedDeltaNet layer: the pre-norm block with our recording mixer
        h = x + seg.gdn(layer.linear_attn, i, layer.input_layernorm(x))
        return seg.unview(h + layer.mlp(layer.post_attention_layernorm(h)))
    if family.shares_kv:
        return seg.unview(family.call_shared(inner, layer, g, x, seg.mask(i), seg.kv(i), extra))
    return seg.unview(family.call_layer(layer, x, seg.mask(i), seg.kv(i)))


def _split(layer: nn.Module, i: int, segs: Sequence[Segment], h: mx.array, parts) -> mx.array:
    """Layer i on every segment at once: norms and MLP on the stream, the mixer per segment."""
    normed = layer.input_layernorm(h)
    attn = getattr(layer, "self_attn", None)
    if not _is_linear(layer) and plain_attention(attn):
        q, k, v = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
        mixed = attn.o_proj(mx.concatenate([seg.attend(attn, i, qs, ks, vs) for seg, qs, ks, vs
                                            in zip(segs, parts(q), parts(k), parts(v))], axis=1))
    else:
        mixed = mx.concatenate([seg.unview(_mix(layer, i, seg, seg.view(x))) for seg, x in zip(segs, parts(normed))],
                               axis=1)
    h = h + mixed
    return h + layer.mlp(layer.post_attention_layernorm(h))


def walk(target, segments: Sequence[Segment]) -> Tuple[mx.array, Dict[int, mx.array]]:
    """The target's layers over every segment: (last hidden state [1, N, H], tapped layer outputs by global id)."""
    family, lm, inner, first = target.family, target.lm, target.inner, target.first_layer
    bounds = np.cumsum([0] + [s.width for s in segments]).tolist()

    def parts(x: mx.array) -> List[mx.array]:
        return [x[:, bounds[j]: bounds[j + 1]] for j in range(len(segments))]

    ids = segments[0].ids if len(segments) == 1 else mx.concatenate([s.ids for s in segments], axis=1)
    h = family.embed(lm, inner, ids)
    extras = family.layer_inputs(inner, ids, h) if family.layer_inputs is not None else None
    for seg, x in zip(segments, parts(h)):
        seg.begin(target, x)
    h = target.receive(h)  # a pipeline stage's input is the stage before's output
    states = [{} for _ in segments]  # per segment: what a family threads between layers (Gemma 4's shared KV)
    taps, kept = set(target.tap_layer_ids), {}
    for i, layer in enumerate(target.layers):
        g = first + i
        if (len(segments) > 1 or segments[0].split_alone) and splittable(layer):
            h = _split(layer, i, segments, h, parts)
        else:
            outs = []
            for j, (seg, x) in enumerate(zip(segments, parts(h))):
                extra = states[j]
                if extras is not None:
                    extra["input"] = extras[g][:, bounds[j]: bounds[j + 1]] if len(segments) > 1 else extras[g]
                outs.append(_whole(family, inner, layer, i, g, seg, x, extra))
            h = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        if g in taps:
            kept[g] = h
    for seg in segments:
        seg.finish()
    return h, kept


def run(target, segments: Sequence[Segment]) -> Tuple[List[mx.array], List[mx.array]]:
    """Each segment's logits [1, w, V] and tapped features [1, w, n*H] after one walk over all of them."""
    h, kept = walk(target, segments)
    logits = target.head(target.inner.norm(h))
    feats = [kept[i] for i in target.tap_layer_ids]
    hidden = mx.concatenate(feats, axis=-1) if len(feats) > 1 else (feats[0] if feats else h[..., :0])
    if len(segments) == 1:
        return [logits], [hidden]
    bounds = np.cumsum([0] + [s.width for s in segments]).tolist()
    return ([logits[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])],
            [hidden[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])])

