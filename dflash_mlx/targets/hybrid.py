"""Gated DeltaNet layers of hybrid targets (Qwen3.5/3.6, Qwen3-Next) with exact rollback of their state.

A GatedDeltaNet layer keeps a short conv state and a recurrent state; mlx-lm's `ArraysCache` for them cannot be
trimmed. Our walk runs the layer's math itself, from its own submodules and mlx-lm's functions (`normalize_qk`,
`gated_delta_update`), so that each write can keep what undoing it needs. Nothing in mlx-lm is patched.

Default scheme (docs/rollback.md, `ReplayRollback`): a write keeps the state it started from and its
recurrence inputs; dropping its newest n tokens re-runs only the recurrence over the kept prefix from that state,
and the conv state is a slice of the recorded conv input. Both are bit-exact: the recurrence is sequential per
step and elementwise in its gates, so a prefix replay computes the same numbers the write did.
`TapeRollback` (S3, the default where Metal kernels run) has the verify pass write a tape of per-step innovations
and replays only the kept steps' state updates; other schemes subclass `RecurrentRollback`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from ..errors import DFlashError
from ..metal import available as metal_available
from ..metal import gdn_tape


@dataclass
class GDNWrite:
    """One write to a GatedDeltaNet layer, as a rollback needs it. Shapes are mlx-lm's."""

    conv_state: Optional[mx.array]  # [B, K-1, C] before the write (None: fresh cache)
    state: Optional[mx.array]  # [B, Hv, Dv, Dk] before the write (None: fresh cache)
    conv_input: mx.array  # [B, K-1+T, C]: the conv window, then the write's pre-conv q|k|v
    q: mx.array  # [B, T, Hk, Dk], normalized as gated_delta_update expects
    k: mx.array  # [B, T, Hk, Dk]
    v: mx.array  # [B, T, Hv, Dv]
    a: mx.array  # [B, T, Hv]
    b: mx.array  # [B, T, Hv]
    A_log: mx.array
    dt_bias: mx.array
    mask: Optional[mx.array]
    kept: int  # tokens of this write still in the cache
    use_kernel: bool = True  # the replay must take the same path (Metal kernel or ops) as the write
    tape: Any = None  # whatever else a strategy's `advance` produced (e.g. per-step innovations)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[1]


class RecurrentRollback:
    """How a GatedDeltaNet write advances the recurrent state, and how a suffix of it is undone.

    `advance` runs during every write (prefill chunk, verify block, decode step); `restore` runs only when a
    rollback drops tokens. The default pair is `ReplayRollback`.
    """

    name = "abstract"
    # Longer writes (prefill chunks) are not recorded: nothing rolls them back, and recording would pin their
    # activations in memory.
    max_record_tokens = 256

    def advance(self, q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel: bool) -> Tuple[mx.array, mx.array, Any]:
        """Returns (y [B, T, Hv, Dv], state after the write, tape kept in the write's record)."""
        raise NotImplementedError

    def restore(self, write: GDNWrite, keep: int) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """(conv state, recurrent state) after only the first `keep` tokens of `write` (0 <= keep < T)."""
        raise NotImplementedError


class ReplayRollback(RecurrentRollback):
    """S2: re-run mlx-lm's `gated_delta_update` (its Metal kernel where present) on the kept prefix."""

    name = "replay"

    def advance(self, q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel):
        y, state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel)
        return y, state, None

    def restore(self, write: GDNWrite, keep: int):
        if keep == 0:
            return write.conv_state, write.state
        w = write
        mask = None if w.mask is None else w.mask[:, :keep]
        _, state = gated_delta_update(w.q[:, :keep], w.k[:, :keep], w.v[:, :keep], w.a[:, :keep], w.b[:, :keep],
                                      w.A_log, w.dt_bias, w.state, mask, use_kernel=w.use_kernel)
        # The conv window after `keep` tokens: the K-1 inputs ending at token keep-1.
        n_keep = w.conv_input.shape[1] - w.num_tokens
        return mx.contiguous(w.conv_input[:, keep : keep + n_keep]), state


class GatedDeltaCache(ArraysCache):
    """mlx-lm's two-slot `ArraysCache` (conv state, recurrent state) plus the record of its newest write.

    `trim(n)` drops the newest n tokens of that write exactly, so the cache is trimmable like a KV cache. It works
    with mlx-lm's own model call too (the call just does not record, and a later trim says so).

    mlx-lm's cache protocol: `state` is `ArraysCache`'s (the two states, left padding, lengths), which after a trim
    already are the kept prefix's; `meta_state` names the rollback scheme. The record is scratch for one rollback:
    `state`, `nbytes`, `copy` and a reloaded cache leave it out, so those can only roll back their next write.
    """

    def __init__(self, rollback: Optional[RecurrentRollback] = None):
        super().__init__(size=2)
        self.rollback = rollback or ReplayRollback()
        self.last_write: Optional[GDNWrite] = None
        self._after: Any = None  # the state array the record belongs to

    def record(self, write: Optional[GDNWrite]) -> None:
        self.last_write = write
        self._after = self.cache[1]

    @property
    def meta_state(self):
        return (self.rollback.name,)

    @meta_state.setter
    def meta_state(self, v):
        self.rollback = rollback_named(v[0]) if v else default_rollback()

    @classmethod
    def from_state(cls, state, meta_state: Optional[Sequence[str]] = None) -> "GatedDeltaCache":
        obj = cls(rollback_named(meta_state[0]) if meta_state else default_rollback())
        obj.state = state
        obj.record(None)
        return obj

    def copy(self) -> "GatedDeltaCache":
        """An independent cache without the record (which belongs to this cache's last write)."""
        twin = type(self)(self.rollback)
        # Fresh array objects: an in-place store into one cache's array must not reach the other's.
        fresh = [None if a is None else a[...] for a in (self.left_padding, self.lengths)]
        twin.state = ([None if a is None else a[...] for a in self.cache], *fresh)
        twin.record(None)
        return twin

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        w = self.last_write
        if w is None or self.cache[1] is not self._after:
            raise DFlashError(
                "cannot roll back a GatedDeltaNet cache that was last written without a record (a long prefill chunk "
                "or mlx-lm's own model call); run verify blocks through the TargetModel"
            )
        if n > w.kept:
            raise DFlashError(f"cannot roll back {n} tokens: the newest write to this GatedDeltaNet cache kept {w.kept}")
        keep = w.kept - n
        self.cache[0], self.cache[1] = self.rollback.restore(w, keep)
        w.kept = keep
        self._after = self.cache[1]
        return n


def _project_qwen3_5(attn: nn.Module, x: mx.array):
    B, S, _ = x.shape
    qkv = attn.in_proj_qkv(x)
    z = attn.in_proj_z(x).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
    return qkv, z, attn.in_proj_b(x), attn.in_proj_a(x)


def _project_qwen3_next(attn: nn.Module, x: mx.array):
    B, S, _ = x.shape
    q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    return qkv, z, b, a


_DEFAULT_ROLLBACK = ReplayRollback()


def gdn_project(attn: nn.Module, x: mx.array):
    """The layer's input projections (qwen3_5 and qwen3_next layouts): (pre-conv qkv, z, b, a)."""
    project = _project_qwen3_next if "in_proj_qkvz" in attn else _project_qwen3_5
    return project(attn, x)


def gdn_heads(attn: nn.Module, conv_out: mx.array):
    """q, k (normalized) and v per head [B, S, heads, d] from the convolution's output [B, S, C]."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def gdn_output(attn: nn.Module, out: mx.array, z: mx.array) -> mx.array:
    """The gated norm and output projection of the recurrence's output [B, S, Hv, Dv]."""
    B, S = out.shape[:2]
    out = attn.out_proj(attn.norm(out, z).reshape(B, S, -1))
    # Tensor parallel (mlx-lm's `shard`): this rank ran its share of the heads; the layer output is their sum.
    group = getattr(attn, "sharding_group", None)
    return out if group is None else mx.distributed.all_sum(out, group=group)


def gated_delta_net(attn: nn.Module, x: mx.array, mask: Optional[mx.array], cache: Optional[Any]) -> mx.array:
    """mlx-lm's GatedDeltaNet forward over a chain of tokens, recording each cached write (the tree's twin,
    `tree.gdn_tree`, shares its projections, heads and output: `gdn_project`, `gdn_heads`, `gdn_output`)."""
    B, S, _ = x.shape
    qkv, z, b, a = gdn_project(attn, x)

    n_keep = attn.conv_kernel_size - 1
    prev_conv = cache[0] if cache is not None else None
    conv_state = prev_conv if prev_conv is not None else mx.zeros((B, n_keep, attn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        if cache.lengths is not None:
            raise DFlashError("batched (length-padded) GatedDeltaNet caches are not supported")
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    q, k, v = gdn_heads(attn, nn.silu(attn.conv1d(conv_input)))
    prev_state = cache[1] if cache is not None else None

    rollback = cache.rollback if isinstance(cache, GatedDeltaCache) else _DEFAULT_ROLLBACK
    out, state, tape = rollback.advance(q, k, v, a, b, attn.A_log, attn.dt_bias, prev_state, mask,
                                        use_kernel=not attn.training)
    if cache is not None:
        cache[1] = state
        cache.advance(S)
        if isinstance(cache, GatedDeltaCache):
            write = None
            if S <= rollback.max_record_tokens:
                write = GDNWrite(prev_conv, prev_state, conv_input, q, k, v, a, b, attn.A_log, attn.dt_bias,
                                 mask, kept=S, use_kernel=not attn.training, tape=tape)
            cache.record(write)
    return gdn_output(attn, out, z)


def hybrid_call_layer(layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
    """A qwen3_5 / qwen3_next decoder layer; attention layers are mlx-lm's own call."""
    if not layer.is_linear:
        return layer(h, mask, cache)
    r = gated_delta_net(layer.linear_attn, layer.input_layernorm(h), mask, cache)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))


class TapeRollback(RecurrentRollback):
    """S3: the verify pass also writes a tape (per-step decay g_t and innovation delta_t); rollback replays only the
    kept steps' state updates from the pre-verify state. Kernels on Metal, pure MLX elsewhere (both bit-exact to
    their own forward pass; see dflash_mlx.metal.gdn_tape). Padding masks fall back to `ReplayRollback`."""

    name = "tape"

    def advance(self, q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel):
        if mask is not None or q.shape[1] > self.max_record_tokens:  # nothing to tape: mlx-lm's fastest path
            return _DEFAULT_ROLLBACK.advance(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel)
        g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)  # as gated_delta_update computes them
        metal = use_kernel and gdn_tape.use_kernel(q, k, v, g)
        y, state, delta = gdn_tape.gdn_tape(q, k, v, g, beta, state, metal=metal)
        return y, state, (g, delta, metal)

    def restore(self, write: GDNWrite, keep: int):
        if keep == 0 or write.tape is None:
            return _DEFAULT_ROLLBACK.restore(write, keep)
        g, delta, metal = write.tape
        state = write.state
        if state is None:
            B, _, Hv, Dv = write.v.shape
            state = mx.zeros((B, Hv, Dv, write.k.shape[-1]), dtype=mx.float32)
        state = gdn_tape.gdn_replay(write.k, g, delta, state, keep, metal=metal)
        n_keep = write.conv_input.shape[1] - write.num_tokens
        return mx.contiguous(write.conv_input[:, keep : keep + n_keep]), state


def default_rollback() -> RecurrentRollback:
    """The tape where Metal kernels run; elsewhere the replay, so nothing changes on the CPU backend."""
    return TapeRollback() if metal_available() else ReplayRollback()


def rollback_named(name: str) -> RecurrentRollback:
    """The built-in scheme called `name` (as `meta_state` records it); `default_rollback()` for any other name."""
    for scheme in (ReplayRollback, TapeRollback):
        if scheme.name == name:
            return scheme()
    return default_rollback()
