"""Verify a draft tree in one target forward pass, then keep exactly the accepted path's cache rows.

`tree_forward` runs the n+1 block slots through the package's one layer walk as a `walk.Tree` segment. A pre-norm
layer with mlx-lm's plain attention runs its norms, projections and MLP on the n+1 tokens as a chain would, and
`Tree.attend` rotates each node at its own position (the nodes as a batch of n+1 one-token rows for `mx.fast.rope`,
which takes one offset per batch row), then attends with them as ONE sequence of n+1 query rows against the cached
rows and the new ones, under the ancestor mask: the cost of a chain of n+1 tokens. Any other layer (MLA, Gemma's
attention) sees the nodes as a BATCH of n+1 one-token sequences ([n+1, 1, H]) and runs whole; nothing in mlx-lm is
patched. Each attention layer gets a `TreeKV` stand-in for its cache:
- `offset` is an array [n+1] (cache offset + depth of each node): mlx-lm's attentions pass `cache.offset` to
  `mx.fast.rope`, which takes one offset per batch row, so every node is rotated at its own chain position;
- `update_and_fetch` returns, for every row, the real cache's visible rows followed by all n+1 new rows, and keeps
  the new rows for `commit_path`; the real cache is only read;
- the mask the walk passes is boolean [n+1, 1, 1, S+n+1]: cached rows (within the window for sliding layers) and
  the node's ancestors and itself.
MLP / MoE layers are per token. GatedDeltaNet layers (hybrid targets) run here, from the layer's submodules as
`hybrid.gated_delta_net` does: each node's conv window is gathered along its ancestors (the root's from the conv
state) and the recurrent state advances level by level (depth order) from the parent's state with mlx-lm's
`gated_delta_update`; every node's state is kept in the `TreeWrite` so `commit_path` can take the path's last.

`commit_path` then writes the kept path into the real caches as ONE chain write (`update_and_fetch` of the path's
rows; conv state, recurrent state and a `GDNWrite` record for GatedDeltaNet caches), so a later `rollback` of
part of the path is as exact as after a chain verify. Rows are the tree's own numbers. Where matmuls round each
row alike (CPU bf16; fp32 on MLX's bundled BLAS) they are bit-identical to a chain pass of the path, logits and
caches (not deepseek_v3: its MLA takes another formula for one-token queries); with the OpenBLAS this package
loads, fp32 rows round by row count, so they agree to ~1e-5 of the logit scale, as a block chain does with a
token-at-a-time chain. Cost: as a chain of n+1 tokens on plain attention; where the nodes run as a batch, each
node's attention reads all cached rows (broadcast over the n+1 rows).

`tree_support` says why a target/cache cannot take trees (callers then verify chains).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update

from ..errors import DFlashError
from .adapter import TargetModel, split_into_stages
from .attention import attention
from .walk import Segment, run
from .hybrid import GatedDeltaCache, GDNWrite, ReplayRollback, TapeRollback, gdn_heads, gdn_output, gdn_project
from .rotating import WindowKVCache


# -- support ---------------------------------------------------------------------------------------------------
def is_gdn(target: TargetModel, c: Any) -> bool:
    return target.family.gated_delta and isinstance(c, ArraysCache)


def tree_support(target: TargetModel, cache: Sequence[Any]) -> Optional[str]:
    """None when `tree_forward` works for this target and cache, else a one-line reason (callers use chains)."""
    if target.stage_aware or split_into_stages(target.model) or type(target).forward is not TargetModel.forward:
        return "target runs a pipeline stage or its own walk"
    if len(cache) != target.num_layers and not (target.family.shares_kv and len(cache) < target.num_layers):
        return "cache does not have one entry per layer"
    offsets = set()
    for i, c in enumerate(cache):
        if is_gdn(target, c):
            if c.lengths is not None or c.left_padding is not None:
                return "batched (length-padded) GatedDeltaNet cache"
            if c[1] is not None and c[1].shape[0] != 1:
                return "batch size of the cache is not 1"
            continue
        if type(c) not in (KVCache, WindowKVCache):
            what = "quantized KV cache" if hasattr(c, "bits") else f"cache type {type(c).__name__}"
            return f"{what} at layer {i} (trees need KVCache / WindowKVCache from TargetModel.make_cache())"
        if c.keys is not None and c.keys.shape[0] != 1:
            return "batch size of the cache is not 1"
        offsets.add(c.offset)
    if len(offsets) != 1:
        return "no attention cache, or attention caches at different offsets"
    for layer in target.layers:
        for m in layer.modules():
            if type(m).__name__ == "DynamicNTKScalingRoPE":  # computes with `offset` as a Python int
                return "dynamic-NTK RoPE cannot take per-node offsets"
    return None


# -- the stand-in cache of an attention layer ------------------------------------------------------------------
def _visible(c: Any) -> Tuple[Optional[mx.array], Optional[mx.array]]:
    """The real cache's rows any node may see, oldest first (a window cache: its last max_size - 1)."""
    if c.keys is None or c.offset == 0:
        return None, None
    if isinstance(c, WindowKVCache):
        k, v = c.keys_and_values()
        n = min(k.shape[2], c.max_size - 1)
        return k[..., k.shape[2] - n :, :], v[..., v.shape[2] - n :, :]
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


class TreeKV:
    """What an mlx-lm attention sees as its cache during a tree pass (see module docstring)."""

    def __init__(self, real: Any, offsets: mx.array):
        self.real = real
        self.offset = offsets  # [n+1]: one RoPE position per batch row
        self.new: Optional[Tuple[mx.array, mx.array]] = None

    def sequence(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """The nodes' keys and values [n+1, heads, 1, d], kept for `commit_path`, laid after the cached rows as one
        sequence [1, heads, S+n+1, d]."""
        self.new = (keys, values)
        ks, vs = keys.transpose(2, 1, 0, 3), values.transpose(2, 1, 0, 3)
        pk, pv = _visible(self.real)
        if pk is not None:
            ks, vs = mx.concatenate([pk, ks], axis=2), mx.concatenate([pv, vs], axis=2)
        return ks, vs

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # Every batch row (node) sees the cached rows, then all n+1 new ones (the mask picks); SDPA wants equal
        # batch sizes for queries and keys.
        n = keys.shape[0]
        ks, vs = self.sequence(keys, values)
        return (mx.broadcast_to(ks, (n, *ks.shape[1:])), mx.broadcast_to(vs, (n, *vs.shape[1:])))


def tree_mask(c: Any, offset: int, depth: np.ndarray, anc: np.ndarray) -> mx.array:
    """Boolean [n+1, 1, 1, S+n+1]: the cached rows (within the window), then ancestors-or-self."""
    n1 = len(depth)
    pk, _ = _visible(c)
    cached = 0 if pk is None else pk.shape[2]
    kpos = np.concatenate([np.arange(offset - cached, offset), offset + depth])
    seen = np.concatenate([np.ones((n1, cached), bool), anc], axis=1)
    if isinstance(c, WindowKVCache):  # a query at p sees keys at p - W + 1 .. p
        qpos = offset + depth
        seen &= kpos[None, :] > qpos[:, None] - c.max_size
    return mx.array(seen[:, None, None, :])


# -- GatedDeltaNet along the tree ------------------------------------------------------------------------------
@dataclass
class _GDNTree:
    conv_state: Optional[mx.array]  # [1, K-1, C] before the pass (None: fresh cache)
    state: Optional[mx.array]  # [1, Hv, Dv, Dk] before the pass
    qkv: mx.array  # [n+1, C]: pre-conv inputs per node
    q: mx.array  # [n+1, 1, Hk, Dk] (normalized)
    k: mx.array
    v: mx.array  # [n+1, 1, Hv, Dv]
    a: mx.array  # [n+1, 1, Hv]
    b: mx.array
    states: List[mx.array]  # per depth level: [nodes at that depth, Hv, Dv, Dk]
    A_log: mx.array
    dt_bias: mx.array
    use_kernel: bool
    conv_keep: int  # K - 1
    after: Any  # the cache's state array the pass read (a commit checks it is still there)


def _conv_index(parents: Sequence[int], keep: int) -> np.ndarray:
    """[n+1, keep+1] rows of concat(conv state (keep rows), node inputs) forming each node's conv window."""
    idx = np.zeros((len(parents), keep + 1), np.int64)
    for i in range(len(parents)):
        cur = keep + i
        for j in range(keep, -1, -1):
            idx[i, j] = cur
            if cur >= keep:  # a node: its parent, or the root's predecessor, the conv state's last row
                cur = keep + parents[cur - keep] if cur > keep else keep - 1
            else:
                cur -= 1
    return idx


def gdn_tree(attn: nn.Module, x: mx.array, cache: Any, parents: Sequence[int], levels: List[List[int]]):
    """GatedDeltaNet over the tree's nodes (x: [n+1, 1, D]); returns (output, record)."""
    qkv, z, b, a = gdn_project(attn, x)
    keep = attn.conv_kernel_size - 1
    prev_conv, prev_state = cache[0], cache[1]
    conv_state = prev_conv if prev_conv is not None else mx.zeros((1, keep, attn.conv_dim), dtype=x.dtype)
    table = mx.concatenate([conv_state[0], qkv[:, 0]], axis=0)
    windows = table[mx.array(_conv_index(parents, keep))]  # [n+1, K, C]
    q, k, v = gdn_heads(attn, nn.silu(attn.conv1d(windows)))  # [n+1, 1, heads, d]
    use_kernel = not attn.training
    # One recurrence step per depth level, each node from its parent's state (elementwise: the chain's numbers).
    slot = {}
    states, ys = [], []
    for d, nodes in enumerate(levels):
        if d == 0:
            s_in = prev_state
        else:
            s_in = mx.take(states[d - 1], mx.array([slot[parents[i]] for i in nodes]), axis=0)
        rows = mx.array(nodes)
        y, s = gated_delta_update(q[rows], k[rows], v[rows], a[rows], b[rows], attn.A_log, attn.dt_bias, s_in,
                                  None, use_kernel=use_kernel)
        slot.update({i: j for j, i in enumerate(nodes)})
        states.append(s)
        ys.append(y)
    order = [i for nodes in levels for i in nodes]
    inverse = np.argsort(np.array(order))
    out = mx.take(mx.concatenate(ys, axis=0), mx.array(inverse), axis=0)  # [n+1, 1, Hv, Dv]
    out = gdn_output(attn, out, z)
    record = _GDNTree(prev_conv, prev_state, qkv[:, 0], q, k, v, a, b, states, attn.A_log, attn.dt_bias,
                      use_kernel, keep, prev_state)
    return out, record


# -- the pass --------------------------------------------------------------------------------------------------
@dataclass
class TreeWrite:
    """What a tree pass computed that `commit_path` needs: the tree, and per layer its new rows or GDN record."""

    parents: Tuple[int, ...]
    depths: Tuple[int, ...]
    offset: int  # cache offset at the pass (the root's position)
    layers: List[Any] = field(default_factory=list)  # (keys, values) [n+1, h, 1, d] | _GDNTree
    slots: Dict[int, int] = field(default_factory=dict)  # node -> index in its depth level's states


def _check_parents(parents: Sequence[int]) -> Tuple[int, ...]:
    parents = tuple(int(p) for p in parents)
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise DFlashError(f"bad tree parents {list(parents)}: need parents[0] == -1 and 0 <= parents[i] < i")
    return parents


class Tree(Segment):
    """A draft tree's nodes verified against the caches, which are only read (see the module docstring)."""

    split_alone = True  # plain attention restated (`attend`): the nodes attend as one sequence

    def __init__(self, ids: mx.array, cache: List[Any], parents: Sequence[int]):
        super().__init__(ids, cache)
        self.parents = tuple(parents)
        n1 = len(self.parents)
        depths = [0] * n1
        anc = np.eye(n1, dtype=bool)
        for j in range(1, n1):
            depths[j] = depths[self.parents[j]] + 1
            anc[j] |= anc[self.parents[j]]
        self.depth, self.anc = np.array(depths), anc
        self.levels = [[j for j in range(n1) if depths[j] == d] for d in range(max(depths) + 1)]
        self.offset = 0
        self.write = TreeWrite(self.parents, tuple(depths), 0)
        self.write.slots = {j: k for nodes in self.levels for k, j in enumerate(nodes)}
        self._masks: Dict[Tuple, mx.array] = {}
        self._layer_masks: Dict[int, mx.array] = {}
        self._stand_ins: Dict[int, Any] = {}
        self._records: Dict[int, Any] = {}

    def begin(self, target, h: mx.array) -> None:
        self.target = target
        self.offset = next(c.offset for c in self.cache if not is_gdn(target, c))
        self.write.offset = self.offset
        self.offsets = mx.array(self.offset + self.depth, dtype=mx.int32)

    def view(self, x: mx.array) -> mx.array:
        return x.reshape(self.width, 1, x.shape[-1])

    def unview(self, x: mx.array) -> mx.array:
        return x.reshape(1, self.width, x.shape[-1])

    def mask(self, i: int) -> Any:
        if i not in self._layer_masks:
            c = self.cache_at(i)
            if c is None:  # a KV-sharing layer (Gemma 4): its source layer's mask
                return self._layer_masks[self.target.inner.previous_kvs[i]]
            # Layers whose caches hold the same rows share one mask.
            key = (type(c), getattr(c, "max_size", None), c.offset, getattr(c, "_idx", None))
            if key not in self._masks:
                self._masks[key] = tree_mask(c, self.offset, self.depth, self.anc)
            self._layer_masks[i] = self._masks[key]
        return self._layer_masks[i]

    def kv(self, i: int) -> Any:
        c = self.cache_at(i)
        if c is None:
            return None
        self._stand_ins[i] = TreeKV(c, self.offsets)
        return self._stand_ins[i]

    def gdn(self, attn: nn.Module, i: int, x: mx.array) -> mx.array:
        out, self._records[i] = gdn_tree(attn, x, self.cache_at(i), self.parents, self.levels)
        return out

    def attend(self, attn, i, q, k, v):
        n = self.width
        stand_in = self.kv(i)
        queries = q.reshape(n, 1, attn.n_heads, -1)
        keys = k.reshape(n, 1, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        values = v.reshape(n, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # RoPE per node (its own position: one batch row each), then the nodes as ONE sequence of n query rows
        # against the cached rows and the n new ones, the mask giving each node its ancestors: the attention of
        # a chain of n tokens, where n one-token sequences would each read the whole cache.
        queries, keys = attn.rope(queries, offset=self.offsets), attn.rope(keys, offset=self.offsets)
        keys, values = stand_in.sequence(keys, values)
        mask = self.mask(i)
        out = attention(queries.transpose(2, 1, 0, 3), keys, values, cache=None, scale=attn.scale,
                        mask=mask.reshape(1, 1, n, mask.shape[-1]))
        return out.transpose(0, 2, 1, 3).reshape(1, n, -1)

    def finish(self) -> None:
        layers = []
        for i in range(len(self.cache)):
            if i in self._records:
                layers.append(self._records[i])
            elif i in self._stand_ins:
                layers.append(self._stand_ins[i].new)
        self.write.layers = layers


def tree_segment(target: TargetModel, ids: mx.array, parents: Sequence[int], cache: Sequence[Any]) -> Tree:
    """The tree as a segment of a pass (`walk.Tree`), checked: a target and cache that can take it, parents that
    make a tree, one id per node."""
    reason = tree_support(target, cache)
    if reason is not None:
        raise DFlashError(f"tree verify not supported: {reason}")
    parents = _check_parents(parents)
    if ids.shape != (1, len(parents)):
        raise DFlashError(f"tree ids have shape {ids.shape}, expected (1, {len(parents)})")
    return Tree(ids, list(cache), parents)


def tree_forward(target: TargetModel, ids: mx.array, parents: Sequence[int], cache: Sequence[Any]
                 ) -> Tuple[mx.array, mx.array, TreeWrite]:
    """Logits [1, n+1, V] and tapped hidden [1, n+1, nH] of every tree node, as a chain pass of its root-to-node
    path would give them; the caches are left as they were (see module docstring)."""
    segment = tree_segment(target, ids, parents, cache)
    with target.verify_qmm:
        (logits,), (hidden,) = run(target, [segment])
    return logits, hidden, segment.write


# -- commit ----------------------------------------------------------------------------------------------------
def _check_path(write: TreeWrite, path: Sequence[int]) -> List[int]:
    path = [int(s) for s in path]
    ok = bool(path) and path[0] == 0 and all(
        0 < s < len(write.parents) and write.parents[s] == p for p, s in zip(path, path[1:]))
    if not ok:
        raise DFlashError(f"path {path} is not a root-first chain of this tree (parents {list(write.parents)})")
    return path


def _commit_gdn(c: Any, rec: _GDNTree, write: TreeWrite, path: List[int]) -> None:
    m, rows = len(path), mx.array(path)
    qkv = rec.qkv[rows][None]  # [1, m, C]
    # As the chain does it: a fresh cache's conv window is zeros.
    conv_state = rec.conv_state
    if conv_state is None:
        conv_state = mx.zeros((1, rec.conv_keep, qkv.shape[-1]), dtype=qkv.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    last = path[-1]
    c[0] = mx.contiguous(conv_input[:, -rec.conv_keep :, :])
    c[1] = rec.states[write.depths[last]][write.slots[last]][None]
    c.advance(m)
    if isinstance(c, GatedDeltaCache):
        record = None
        # The replay restore is exact for this write (elementwise steps); other schemes get no record, so a
        # later rollback of this write refuses loudly instead of being wrong.
        if type(c.rollback) in (ReplayRollback, TapeRollback) and m <= c.rollback.max_record_tokens:
            def chain(t):  # [n+1, 1, ...] -> the path's [1, m, ...]
                return t[rows].swapaxes(0, 1)

            record = GDNWrite(rec.conv_state, rec.state, conv_input, chain(rec.q), chain(rec.k), chain(rec.v),
                              chain(rec.a), chain(rec.b), rec.A_log, rec.dt_bias, None, kept=m,
                              use_kernel=rec.use_kernel, tape=None)
        c.record(record)


def commit_path(target: TargetModel, cache: Sequence[Any], write: TreeWrite, path: Sequence[int]) -> None:
    """Write the tree path `path` (block slots, root first) into `cache` as one chain write of those tokens."""
    path = _check_path(write, path)
    if len(write.layers) != len(cache):
        raise DFlashError("tree write and cache have different numbers of layers")
    # Refuse a stale write: the caches must be exactly as the tree pass read them.
    for c, rec in zip(cache, write.layers):
        stale = (rec.after is not c[1]) if isinstance(rec, _GDNTree) else (c.offset != write.offset)
        if stale:
            raise DFlashError("the cache changed since this tree pass; commit its path right after the pass")
    rows = mx.array(path)
    for c, rec in zip(cache, write.layers):
        if isinstance(rec, _GDNTree):
            _commit_gdn(c, rec, write, path)
        else:
            keys, values = rec
            c.update_and_fetch(keys[rows].transpose(2, 1, 0, 3), values[rows].transpose(2, 1, 0, 3))
