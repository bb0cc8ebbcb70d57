"""Gated DeltaNet verify with a tape, and the replay that rolls a hybrid target back to the accepted prefix.

A verify block of T tokens advances each GatedDeltaNet layer's recurrent state; after acceptance only the first
`keep` steps must count. `gdn_tape` runs the recurrence (the same numbers as mlx-lm's `gated_delta_update`) and
also returns the tape: g (the decay) and delta_t = (v_t - S k_t) * beta_t, per step. `gdn_replay` rebuilds the
state after `keep` steps from the pre-verify state with only S = g_t S, then S = S + delta_t k_t^T: no q, no
kv read-out, no y, and, because it repeats the forward pass's own expressions on its own delta_t, the same bits.

Shapes are mlx-lm's: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk].
`*_reference` are pure MLX; `*_metal` the kernels (`gdn_tape.metal`); `gdn_tape` / `gdn_replay` dispatch.
`TapeRollback` in `dflash_mlx.targets.hybrid` plugs them into rollback.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import mlx.core as mx

from .kernel_file import kernels_on, load_kernel_file

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_DK = 256


# The two state updates, written once and shared by the forward pass and the replay, as dflash_gdn_decay and
# dflash_gdn_update are in the kernels. Each is a compiled function of its own, so both passes run the same fused
# code on operands of the same shapes and dtypes: whatever a backend's compiler contracts inside it, it contracts
# alike for both, and nothing can fuse the decay into the update in one pass only. MLX has no fused multiply-add,
# so the update rounds k * delta before the add, as mlx-lm's ops do (the kernels fuse it: see docs/kernels.md).
@mx.compile
def _decay(state, g):
    return state * g[..., None, None]


@mx.compile
def _update(decayed, k, delta):
    return decayed + k[..., None, :] * delta[..., None]


@mx.compile
def _innovation(decayed, k, v, beta):
    kv_mem = (decayed * k[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    return (v - kv_mem) * beta[..., None]


@mx.compile
def _read(state, q):
    return (state * q[..., None, :]).sum(axis=-1).astype(q.dtype)


def _tape_step(q, k, v, g, beta, state):
    # mlx-lm's per-step ops (scalar gate, no mask), op for op, plus delta as an output.
    decayed = _decay(state, g)
    delta = _innovation(decayed, k, v, beta)
    state = _update(decayed, k, delta)
    return _read(state, q), state, delta


def _zeros_state(k: mx.array, v: mx.array) -> mx.array:
    B, _, _, Dk = k.shape
    return mx.zeros((B, v.shape[2], v.shape[3], Dk), dtype=mx.float32)


def _repeat_heads(x: mx.array, Hv: int) -> mx.array:
    return mx.repeat(x, Hv // x.shape[-2], -2) if Hv != x.shape[-2] else x


def gdn_tape_reference(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array, mx.array]:
    """(y [B, T, Hv, Dv], state after T steps, delta [B, T, Hv, Dv] float32); y and a float32 state equal mlx-lm's
    ops path. The state keeps its dtype, as the kernel's does: it is carried in float32 and rounded to its own dtype
    once, at the end."""
    state = _zeros_state(k, v) if state is None else state
    dtype = state.dtype
    state = state.astype(mx.float32)
    Hv = v.shape[2]
    q, k = _repeat_heads(q, Hv), _repeat_heads(k, Hv)
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, state, delta = _tape_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1), state.astype(dtype), mx.stack(deltas, axis=1)


def gdn_replay_reference(k: mx.array, g: mx.array, delta: mx.array, state: mx.array, keep: int) -> mx.array:
    """The state after the first `keep` steps of a tape, starting from the state the tape started from; in that
    state's dtype (carried in float32, rounded once at the end, as the forward pass does)."""
    dtype = state.dtype
    state = state.astype(mx.float32)
    k = _repeat_heads(k, delta.shape[2])
    for t in range(keep):
        state = _update(_decay(state, g[:, t]), k[:, t], delta[:, t])
    return state.astype(dtype)


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import kernel  # the factory: mx.fast.metal_kernel on a Mac, the emulator in tests

    src = load_kernel_file("gdn_tape.metal")

    def build(name, input_names, output_names):
        return kernel(name=name, input_names=input_names, output_names=output_names, source=src.bodies[name],
                      header=src.header)

    tape_io = (["q", "k", "v", "g", "beta", "state_in", "steps"], ["y", "state_out", "delta"])
    tape = build("dflash_gdn_tape", *tape_io)
    tape_packed = build("dflash_gdn_tape_packed", *tape_io)
    replay = build("dflash_gdn_replay", ["k", "g", "delta", "state_in", "keep"], ["state_out"])
    return tape, tape_packed, replay


def gdn_tape_metal(q, k, v, g, beta, state=None):
    """The tape kernel; same arguments and results as `gdn_tape_reference`."""
    state = _zeros_state(k, v) if state is None else state
    B, T, _, _ = k.shape
    Hv, Dv = v.shape[2:]
    tape, tape_packed, _ = _kernels()
    # mlx-lm's choice of layout, so that y and the state are the bits its own kernel gives.
    packed = k.shape[3] == 128 and Dv % 8 == 0 and state.dtype == mx.float32 and \
        os.environ.get("MLX_GDN_PACKED", "1") != "0"
    y, state_out, delta = (tape_packed if packed else tape)(
        inputs=[q, k, v, g.astype(mx.float32), beta, state, T],
        template=[("InT", q.dtype), ("StT", state.dtype)],
        grid=(32, Dv // 8, B * Hv) if packed else (32, Dv, B * Hv),
        threadgroup=(32, 2, 1) if packed else (32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv)],
        output_dtypes=[q.dtype, state.dtype, mx.float32],
    )
    return y, state_out, delta


def gdn_replay_metal(k, g, delta, state, keep):
    """The replay kernel; same arguments and result as `gdn_replay_reference`."""
    B, _, _, Dk = k.shape
    Hv, Dv = delta.shape[2:]
    _, _, replay = _kernels()
    (state_out,) = replay(
        inputs=[k, g.astype(mx.float32), delta, state, keep],
        template=[("StT", state.dtype)],
        grid=(Dk, Dv, B * Hv),
        threadgroup=(min(Dk, 32), 8, 1),
        output_shapes=[state.shape],
        output_dtypes=[state.dtype],
    )
    return state_out


def kernel_supports(q: mx.array, k: mx.array, v: mx.array, g: mx.array, mask: Optional[mx.array]) -> bool:
    """Shapes the kernels handle: scalar gates, no padding mask, 32 <= Dk <= 256 with Dk % 32 == 0."""
    Dk = k.shape[-1]
    return (mask is None and g.ndim == 3 and q.dtype in DTYPES and Dk % 32 == 0 and 32 <= Dk <= MAX_DK
            and v.shape[2] % k.shape[2] == 0)


def use_kernel(q: mx.array, k: mx.array, v: mx.array, g: mx.array, mask: Optional[mx.array] = None) -> bool:
    """Whether the dispatchers run the kernels: Metal kernels on, a GPU stream, a supported shape."""
    return kernels_on() and kernel_supports(q, k, v, g, mask)


def gdn_tape(q, k, v, g, beta, state=None, *, metal: bool):
    """The dispatcher for a verify pass (`metal` from `use_kernel`): kernel or reference."""
    if metal:
        return gdn_tape_metal(q, k, v, g, beta, state)
    return gdn_tape_reference(q, k, v, g, beta, state)


def gdn_replay(k, g, delta, state, keep, *, metal: bool):
    """The dispatcher for rollback; `metal` must be what the tape was written with: each replay repeats its own
    forward pass's arithmetic."""
    if metal:
        return gdn_replay_metal(k, g, delta, state, keep)
    return gdn_replay_reference(k, g, delta, state, keep)
