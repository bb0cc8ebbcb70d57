"""Gated DeltaNet tape + replay (dflash_mlx.metal.gdn_tape) and its rollback strategy (`TapeRollback`).

Reference: the tape path computes y and the state bit-identically to mlx-lm's `gated_delta_ops`, and a replay of
any prefix equals the state mlx-lm reaches on that prefix, bit for bit. Kernel: parity with the reference across
dtypes, GQA ratios and head sizes, and the kernel replay equals the kernel's own forward pass on the prefix, bit
for bit, whether the compiler fuses multiply-adds or not (off a Mac every kernel test runs with contraction off
and on). A bf16/fp16 state keeps its dtype in kernel and reference. Rollback: a tiny hybrid target rolled back
through the tape is bit-identical to one that saw only the accepted tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops

from cache_compare import assert_caches_equal, build, prompt
from kernel_cases import DTYPES, metal_backend  # noqa: F401  (the fixture: both contractions off a Mac)
from dflash_mlx.metal import gdn_tape as gt
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.hybrid import GatedDeltaCache, ReplayRollback, TapeRollback, default_rollback


# (B, T, Hk, Hv, Dk, Dv): GQA 1/2/4, Dk 32/64/128, Dv not a multiple of the threadgroup's 4 rows; the last one
# takes the packed Dk = 128 layout (Dv % 8 == 0), as mlx-lm does.
SHAPES = [(1, 5, 2, 2, 32, 16), (1, 4, 1, 4, 64, 8), (2, 3, 2, 4, 32, 6), (1, 3, 1, 2, 128, 4), (1, 4, 2, 4, 128, 16)]
PACKED = SHAPES[4]


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0, with_state=True):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) / Dk**0.5
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # the recurrence runs on L2-normalized keys
    v = mx.random.normal((B, T, Hv, Dv))
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    g = compute_g(mx.random.normal((Hv,)) * 0.5, a, mx.random.normal((Hv,)) * 0.5)
    beta = mx.sigmoid(b).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1 if with_state else None
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state


def _bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


# -- reference ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_reference_tape_is_mlx_lm_bit_for_bit(shape, dtype):
    q, k, v, g, beta, state = _inputs(*shape, DTYPES[dtype])
    y, s, delta = gt.gdn_tape_reference(q, k, v, g, beta, state)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert _bits_equal(y, y_ref) and _bits_equal(s, s_ref)
    assert delta.shape == v.shape and delta.dtype == mx.float32
    T = shape[1]
    for keep in range(T + 1):
        s_prefix = gated_delta_ops(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep],
                                   state)[1] if keep else state
        assert _bits_equal(gt.gdn_replay_reference(k, g, delta, state, keep), s_prefix), f"keep={keep}"


def test_reference_replay_depends_on_the_tape():
    q, k, v, g, beta, state = _inputs(*SHAPES[0], mx.float32)
    _, _, delta = gt.gdn_tape_reference(q, k, v, g, beta, state)
    _, s_prefix = gated_delta_ops(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)
    wrong = delta.at[:, 2].add(1e-3)
    assert not mx.array_equal(gt.gdn_replay_reference(k, g, wrong, state, 3), s_prefix).item()


def test_reference_starts_from_zeros_without_state():
    q, k, v, g, beta, _ = _inputs(*SHAPES[1], mx.float32, with_state=False)
    y, s, _ = gt.gdn_tape_reference(q, k, v, g, beta)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta)
    assert _bits_equal(y, y_ref) and _bits_equal(s, s_ref)


# -- kernel (Metal on a Mac, the MSL emulator elsewhere) -----------------------------------------------------------
def _close(a: mx.array, b: mx.array, dtype) -> None:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    err = mx.abs(a - b).max().item()
    scale = max(1.0, mx.abs(b).max().item())
    assert err <= tol * scale, f"max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(metal_backend, shape, dtype):
    dt = DTYPES[dtype]
    q, k, v, g, beta, state = _inputs(*shape, dt, seed=1)
    y, s, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
    y_ref, s_ref, delta_ref = gt.gdn_tape_reference(q, k, v, g, beta, state)
    assert y.dtype == dt and s.dtype == mx.float32 and delta.dtype == mx.float32
    _close(y, y_ref, dt)
    _close(s, s_ref, mx.float32)
    _close(delta, delta_ref, mx.float32)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [*SHAPES[:3], PACKED])
def test_kernel_replay_is_its_forward_pass_bit_for_bit(metal_backend, shape, dtype):
    dt = DTYPES[dtype]
    q, k, v, g, beta, state = _inputs(*shape, dt, seed=2)
    _, s_full, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
    T = shape[1]
    for keep in range(T + 1):
        _, s_prefix, _ = gt.gdn_tape_metal(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep],
                                           state) if keep else (None, state, None)
        assert _bits_equal(gt.gdn_replay_metal(k, g, delta, state, keep), s_prefix), f"keep={keep}"
    assert _bits_equal(gt.gdn_replay_metal(k, g, delta, state, T), s_full)


@pytest.mark.metal
def test_kernel_replay_rounds_a_low_precision_state_like_its_forward_pass(metal_backend):
    """A bfloat16 state is rounded once, at the end of a write, by the forward pass and the replay alike."""
    q, k, v, g, beta, state = _inputs(*SHAPES[0], mx.bfloat16, seed=5)
    state = state.astype(mx.bfloat16)
    _, _, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
    _, s_prefix, _ = gt.gdn_tape_metal(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)
    assert s_prefix.dtype == mx.bfloat16
    assert _bits_equal(gt.gdn_replay_metal(k, g, delta, state, 3), s_prefix)


@pytest.mark.metal
@pytest.mark.parametrize("shape", [SHAPES[0], PACKED])  # mlx-lm's generic kernel, its packed kernel
def test_kernel_is_mlx_lm_kernel_bit_for_bit(metal_backend, shape):
    """y and state equal mlx-lm's own gated_delta_update kernel (what plain decoding runs), bit for bit, where the
    compiler contracts mlx-lm's update `state + k * delta` into the fma our kernel writes out: on Metal, and on the
    emulator with contraction on (off a Mac mlx-lm's kernels run on the emulator too). With contraction off,
    mlx-lm's kernel rounds k * delta before the add: the two then agree to float rounding only."""
    if metal_backend == "metal":
        from mlx_lm.models import gated_delta

        mlx_lm_kernels = nullcontext([gated_delta])
        exact = True
    else:
        from msl import emulator

        mlx_lm_kernels = emulator.rebuilt(["mlx_lm.models.gated_delta"])
        exact = emulator.current_contraction() == "fast"
    q, k, v, g, beta, state = _inputs(*shape, mx.bfloat16, seed=6)
    with mlx_lm_kernels as (gd,):
        y_ref, s_ref = gd.gated_delta_kernel(q, k, v, g, beta, state)
    y, s, _ = gt.gdn_tape_metal(q, k, v, g, beta, state)
    if exact:
        assert _bits_equal(y, y_ref) and _bits_equal(s, s_ref)
    else:
        assert not _bits_equal(s, s_ref)  # the fma is ours: unfused, mlx-lm's state rounds differently
        _close(y, y_ref, mx.bfloat16)
        _close(s, s_ref, mx.float32)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
def test_reference_keeps_the_state_dtype(state_dtype):
    """A low-precision state comes back in its own dtype, as from the kernel: carried in float32 and rounded once,
    at the end, by the forward pass and the replay alike."""
    dt = DTYPES[state_dtype]
    q, k, v, g, beta, state = _inputs(*SHAPES[0], mx.bfloat16, seed=7)
    state = state.astype(dt)
    _, s, delta = gt.gdn_tape_reference(q, k, v, g, beta, state)
    assert s.dtype == dt
    assert _bits_equal(s, gt.gdn_tape_reference(q, k, v, g, beta, state.astype(mx.float32))[1].astype(dt))
    for keep in range(SHAPES[0][1] + 1):
        s_prefix = gt.gdn_tape_reference(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep],
                                         state)[1] if keep else state
        assert _bits_equal(gt.gdn_replay_reference(k, g, delta, state, keep), s_prefix), f"keep={keep}"


@pytest.mark.metal
@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
def test_kernel_and_reference_keep_the_state_dtype(metal_backend, state_dtype):
    dt = DTYPES[state_dtype]
    q, k, v, g, beta, state = _inputs(*SHAPES[1], mx.bfloat16, seed=8)
    state = state.astype(dt)
    _, s, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
    _, s_ref, delta_ref = gt.gdn_tape_reference(q, k, v, g, beta, state)
    assert s.dtype == s_ref.dtype == dt
    _close(s, s_ref, dt)
    r, r_ref = gt.gdn_replay_metal(k, g, delta, state, 2), gt.gdn_replay_reference(k, g, delta_ref, state, 2)
    assert r.dtype == r_ref.dtype == dt
    _close(r, r_ref, dt)


# -- rollback through the tape -------------------------------------------------------------------------------------
def _hybrid(kind="qwen3_5"):
    # Key head size 32: what the kernels support (the shared family models use 16). In eval mode, as loaded
    # models are: training mode keeps the recurrence on mlx ops.
    gdn = dict(linear_key_head_dim=32, linear_value_head_dim=16)
    if kind == "qwen3_5":
        from cache_compare import CONFIGS

        return build(kind, text_config=dict(CONFIGS[kind]["text_config"], **gdn)).eval()
    return build(kind, **gdn).eval()


def _roll(t: TargetModel, ids, P, B, keep):
    cache = t.make_cache()
    t(ids[:, :P], cache)
    t(ids[:, P : P + B], cache)
    t.rollback(cache, B - keep)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_tape_rollback_is_bit_exact(kind):
    model = _hybrid(kind)
    tape, replay = TargetModel(model, recurrent_rollback=TapeRollback()), TargetModel(model)
    P, B = 6, 5
    ids = mx.array(prompt(P + B, seed=3), dtype=mx.int32)[None]
    for keep in range(B):
        ours = _roll(tape, ids, P, B, keep)
        assert any(isinstance(c, GatedDeltaCache) and c.last_write.tape is not None for c in ours)
        ref = replay.make_cache()
        replay(ids[:, :P], ref)
        if keep:
            replay(ids[:, P : P + keep], ref)
        mx.eval([c.state for c in ref])
        assert_caches_equal(ours, ref)
    # The verify logits are the replay strategy's too: the tape changes nothing the target computes.
    c1, c2 = tape.make_cache(), replay.make_cache()
    assert mx.array_equal(tape(ids, c1)[0], replay(ids, c2)[0]).item()


def test_default_rollback_is_the_replay_without_metal(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_NO_METAL", "1")
    assert isinstance(default_rollback(), ReplayRollback)
    assert isinstance(TargetModel(_hybrid()).recurrent_rollback, ReplayRollback)


@pytest.mark.metal
def test_tape_rollback_through_the_kernels_is_exact(metal_backend):
    """End to end on the kernels: rollback through the tape equals the kernel pass over the accepted prefix."""
    model = _hybrid()
    t = TargetModel(model)
    assert isinstance(t.recurrent_rollback, TapeRollback)  # the default where kernels run
    P, B = 4, 4
    ids = mx.array(prompt(P + B, seed=4), dtype=mx.int32)[None]
    for keep in (0, 2):
        ours = _roll(t, ids, P, B, keep)
        assert all(c.last_write.tape[2] for c in ours if isinstance(c, GatedDeltaCache))
        ref = t.make_cache()
        t(ids[:, :P], ref)
        if keep:
            t(ids[:, P : P + keep], ref)
        mx.eval([c.state for c in ref])
        assert_caches_equal(ours, ref)


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @pytest.mark.metal
    @settings(max_examples=10, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(B=st.integers(1, 2), T=st.integers(1, 6), Hk=st.integers(1, 2), ratio=st.sampled_from([1, 2]),
           Dk=st.sampled_from([32, 64, 128]), Dv=st.sampled_from([1, 3, 8, 12, 16]), data=st.data())
    def test_property_kernel_tape_and_replay(metal_backend, B, T, Hk, ratio, Dk, Dv, data):
        q, k, v, g, beta, state = _inputs(B, T, Hk, Hk * ratio, Dk, Dv, mx.float32, seed=T * Dv)
        # Kernels only: the reference is compiled per shape (mx.compile), too slow to sweep here.
        _, _, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
        keep = data.draw(st.integers(1, T))
        _, s_prefix, _ = gt.gdn_tape_metal(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep],
                                           state)
        assert _bits_equal(gt.gdn_replay_metal(k, g, delta, state, keep), s_prefix)
