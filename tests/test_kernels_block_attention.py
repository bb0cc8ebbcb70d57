"""Drafter block attention (dflash_mlx.metal.block_attention): reference against a direct float64 computation of
the drafter's masks, kernel against the reference across dtypes, head sizes, GQA ratios, windows, causal blocks,
context lengths that are multiples of no tile, chunked contexts and strided cache views."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.metal import block_attention as ba


from kernel_cases import DTYPES, kernels_enabled, metal_backend  # noqa: F401  (the fixture: both contractions)
# (Hq, Hkv, B, D, n_ctx, window, causal, chunk): chunk None = the production choice (one chunk at these sizes).
CASES = [
    (2, 1, 4, 64, 37, None, False, 16),    # bidirectional block, GQA 2, 3 chunks, the last one partial
    (4, 2, 16, 64, 29, 12, True, 13),      # sliding window + causal block, 16 rows, odd chunk size
    (4, 1, 3, 128, 11, 4, True, None),     # window shorter than the block
    (2, 2, 5, 256, 7, None, True, 5),      # head_dim 256, causal only; a chunk boundary between context and block
    (8, 1, 6, 64, 0, None, False, None),   # empty context; GQA 8: 48 rows, two row groups, idle SIMD groups
]


def _case_id(case):
    Hq, Hkv, B, D, n, w, c, ch = case
    return f"h{Hq}/{Hkv}-B{B}-D{D}-ctx{n}-w{w}-{'causal' if c else 'bidir'}-chunk{ch}"


def _inputs(Hq, Hkv, B, D, n_ctx, dtype, seed=0, spare=5):
    """Block q, k, v and a context that is a strided view into a larger cache buffer (as KVCache holds it)."""
    mx.random.seed(seed)
    q = mx.random.normal((1, Hq, B, D)).astype(dtype)
    k = mx.random.normal((1, Hkv, B, D)).astype(dtype)
    v = mx.random.normal((1, Hkv, B, D)).astype(dtype)
    buf_k = mx.random.normal((1, Hkv, n_ctx + spare, D)).astype(dtype)
    buf_v = mx.random.normal((1, Hkv, n_ctx + spare, D)).astype(dtype)
    return q, k, v, buf_k[:, :, :n_ctx], buf_v[:, :, :n_ctx]


def _direct(q, k, v, ctx_k, ctx_v, scale, window, causal):
    """Float64 attention with the drafter's masks written out per (row, key)."""
    q, k, v, ck, cv = (np.array(x.astype(mx.float32), dtype=np.float64)[0] for x in (q, k, v, ctx_k, ctx_v))
    Hq, B, D = q.shape
    group, n_ctx = Hq // k.shape[0], ck.shape[1]
    out = np.zeros_like(q)
    for h in range(Hq):
        keys = np.concatenate([ck[h // group], k[h // group]])
        vals = np.concatenate([cv[h // group], v[h // group]])
        for i in range(B):
            seen = [(window is None or c > n_ctx + i - window) for c in range(n_ctx)]
            seen += [(not causal or j <= i) for j in range(B)]
            s = keys[seen] @ q[h, i] * scale
            p = np.exp(s - s.max())
            out[h, i] = p @ vals[seen] / p.sum()
    return out[None]


@pytest.mark.parametrize("impl", ["reference", "host"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_and_host_are_the_drafter_mask(case, impl):
    """The pure-MLX reference and the CPU backend's host computation (NumPy) against the float64 one; the host
    path leaves a poisoned tail beyond n_ctx unread."""
    Hq, Hkv, B, D, n_ctx, window, causal, _ = case
    q, k, v, ck, cv = _inputs(Hq, Hkv, B, D, n_ctx, mx.float32)
    attend = getattr(ba, f"block_attention_{impl}")
    out = attend(q, k, v, ck, cv, scale=D**-0.5, window=window, causal=causal)
    np.testing.assert_allclose(np.array(out), _direct(q, k, v, ck, cv, D**-0.5, window, causal), atol=2e-5)
    if impl == "host":
        poisoned = [mx.concatenate([c, mx.full((1, Hkv, 3, D), float("nan"))], axis=2) for c in (ck, cv)]
        again = attend(q, k, v, *poisoned, scale=D**-0.5, window=window, causal=causal, n_ctx=n_ctx)
        assert mx.array_equal(out, again).item()


def test_host_takes_attention_sinks_as_the_reference_does():
    q, k, v, ck, cv = _inputs(4, 2, 5, 64, 30, mx.float32, seed=4)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    ref = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=9, causal=True, sinks=sinks)
    out = ba.block_attention_host(q, k, v, ck, cv, scale=0.125, window=9, causal=True, sinks=sinks)
    assert mx.abs(out - ref).max().item() < 2e-5


def test_dispatcher_takes_the_host_for_long_float32_contexts_on_the_cpu(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_NO_METAL", "1")
    calls = []
    real = ba.block_attention_host
    monkeypatch.setattr(ba, "block_attention_host", lambda *a, **kw: calls.append(a[3].shape[2]) or real(*a, **kw))
    n = ba.HOST_MIN_CONTEXT
    for n_ctx, dtype in ((n, mx.float32), (n - 1, mx.float32), (n, mx.bfloat16)):
        q, k, v, ck, cv = _inputs(4, 2, 3, 64, n_ctx, dtype)
        out = ba.block_attention(q, k, v, ck, cv, scale=0.125, window=None, causal=True)
        if dtype == mx.float32:
            ref = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=None, causal=True)
            assert mx.abs(out - ref).max().item() < 2e-5
    assert calls == [n]


def test_reference_reads_only_the_valid_context():
    q, k, v, ck, cv = _inputs(2, 1, 4, 64, 10, mx.float32)
    poisoned_k = mx.concatenate([ck, mx.full((1, 1, 3, 64), float("nan"))], axis=2)
    poisoned_v = mx.concatenate([cv, mx.full((1, 1, 3, 64), float("nan"))], axis=2)
    a = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=6, causal=True)
    b = ba.block_attention_reference(q, k, v, poisoned_k, poisoned_v, scale=0.125, window=6, causal=True, n_ctx=10)
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("window", [0, -3])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_window_zero_means_no_window(window, causal):
    """window <= 0 is no window, as in the kernel (and window=None)."""
    q, k, v, ck, cv = _inputs(2, 1, 4, 64, 10, mx.float32)
    a = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=window, causal=causal)
    b = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=None, causal=causal)
    assert mx.array_equal(a, b).item()


def test_dispatcher_takes_the_reference_without_metal(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_NO_METAL", "1")
    q, k, v, ck, cv = _inputs(4, 2, 6, 64, 20, mx.float32)
    a = ba.block_attention(q, k, v, ck, cv, scale=0.125, window=8, causal=True)
    b = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=8, causal=True)
    assert mx.array_equal(a, b).item()


def test_chunking_covers_long_contexts():
    assert ba.chunk_size(100) == ba.MIN_CHUNK
    n = 100_000
    assert -(-n // ba.chunk_size(n)) <= ba.MAX_CHUNKS


# -- kernel (Metal on a Mac, the MSL emulator elsewhere) -----------------------------------------------------------
_TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # about two units in the last place


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err <= _TOL[dtype] * max(1.0, mx.abs(ref).max().item()), f"max error {err:.3g}"


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(metal_backend, case, dtype):
    Hq, Hkv, B, D, n_ctx, window, causal, chunk = case
    dt = DTYPES[dtype]
    q, k, v, ck, cv = _inputs(Hq, Hkv, B, D, n_ctx, dt, seed=1)
    out = ba.block_attention_metal(q, k, v, ck, cv, scale=D**-0.5, window=window, causal=causal, chunk=chunk)
    # Against the float32 reference on the same (rounded) inputs: the kernel computes in float32 too.
    up = [x.astype(mx.float32) for x in (q, k, v, ck, cv)]
    _check(out, ba.block_attention_reference(*up, scale=D**-0.5, window=window, causal=causal), dt)


@pytest.mark.metal
def test_kernel_reads_strided_views_in_place(metal_backend):
    """Context as a [1, L, Hkv, D] buffer seen as [1, Hkv, L, D], and a poisoned tail beyond n_ctx."""
    mx.random.seed(3)
    Hq, Hkv, B, D, n_ctx = 4, 2, 5, 64, 21
    q, k, v, _, _ = _inputs(Hq, Hkv, B, D, n_ctx, mx.float32, seed=3)
    ck = mx.random.normal((1, n_ctx, Hkv, D)).transpose(0, 2, 1, 3)
    cv = mx.random.normal((1, n_ctx, Hkv, D)).transpose(0, 2, 1, 3)
    ref = ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=9, causal=True)
    _check(ba.block_attention_metal(q, k, v, ck, cv, scale=0.125, window=9, causal=True, chunk=8), ref, mx.float32)
    nan = mx.full((1, Hkv, 3, D), float("nan"))
    pk, pv = mx.concatenate([mx.contiguous(ck), nan], axis=2), mx.concatenate([mx.contiguous(cv), nan], axis=2)
    out = ba.block_attention_metal(q, k, v, pk, pv, scale=0.125, window=9, causal=True, n_ctx=n_ctx, chunk=8)
    _check(out, ref, mx.float32)


@pytest.mark.metal
@pytest.mark.parametrize("window", [0, -3])
def test_kernel_window_zero_means_no_window(metal_backend, window):
    q, k, v, ck, cv = _inputs(4, 2, 5, 64, 21, mx.float32, seed=5)
    out = ba.block_attention_metal(q, k, v, ck, cv, scale=0.125, window=window, causal=True, chunk=8)
    _check(out, ba.block_attention_reference(q, k, v, ck, cv, scale=0.125, window=None, causal=True), mx.float32)
    _check(ba.block_attention(q, k, v, ck, cv, scale=0.125, window=window, causal=True), out, mx.float32)


# A score spike far above every other score (exp(150) overflows float32) in one chunk: the merge must rescale
# every chunk by the largest maximum, chunk 0's included. Without a spike, a merge that skips one chunk's maximum
# gives the same output up to rounding (the weights' common factor cancels), so only a spike shows it.
SPIKE_CASE = (2, 1, 4, 64, 37, 16)  # Hq, Hkv, B, D, n_ctx, chunk: 41 keys in chunks [0, 16), [16, 32), [32, 41)
SPIKE_CHUNKS = 3


def _spike_inputs(spike_chunk: int):
    """Block row 0 of head 0 scores 150 on key 5 of chunk `spike_chunk` (the last chunk's is a block key)."""
    Hq, Hkv, B, D, n_ctx, chunk = SPIKE_CASE
    q, k, v, ck, cv = _inputs(Hq, Hkv, B, D, n_ctx, mx.float32, seed=4)
    row = q[0, 0, 0]
    spike = (row * (150.0 / ((row * row).sum() * D**-0.5)))[None, None, None]
    u = spike_chunk * chunk + 5
    if u < n_ctx:
        ck = mx.concatenate([ck[:, :, :u], spike, ck[:, :, u + 1:]], axis=2)
    else:
        j = u - n_ctx
        k = mx.concatenate([k[:, :, :j], spike, k[:, :, j + 1:]], axis=2)
    return q, k, v, ck, cv


def _spike_matches(spike_chunk: int) -> None:
    Hq, Hkv, B, D, n_ctx, chunk = SPIKE_CASE
    q, k, v, ck, cv = _spike_inputs(spike_chunk)
    ref = ba.block_attention_reference(q, k, v, ck, cv, scale=D**-0.5)
    out = ba.block_attention_metal(q, k, v, ck, cv, scale=D**-0.5, chunk=chunk)
    assert -(-(n_ctx + B) // chunk) == SPIKE_CHUNKS
    _check(out, ref, mx.float32)


@pytest.mark.metal
@pytest.mark.parametrize("spike_chunk", range(SPIKE_CHUNKS))
def test_kernel_merges_a_score_spike_in_any_chunk(metal_backend, spike_chunk):
    _spike_matches(spike_chunk)


@pytest.mark.metal
def test_spike_case_catches_a_merge_that_skips_chunk_0(metal_backend, monkeypatch):
    """The spike cases are what notices a merge that leaves chunk 0 out of the maximum."""
    from dflash_mlx import metal
    from dflash_mlx.metal.kernel_file import load_kernel_file

    body = load_kernel_file("block_attention.metal").bodies["dflash_block_attn_merge"]
    first_loop = "for (int s = 0; s < n_chunks; ++s) {\n  top = max("
    assert body.count(first_loop) == 1
    partial, _ = ba._kernels()
    mutated = metal.kernel(name="dflash_block_attn_merge_skips_chunk_0", input_names=["part_o", "part_m", "part_l"],
                           output_names=["out"], source=body.replace(first_loop, first_loop.replace("s = 0", "s = 1")),
                           header=load_kernel_file("block_attention.metal").header)
    monkeypatch.setattr(ba, "_kernels", lambda: (partial, mutated))
    with pytest.raises(AssertionError):
        _spike_matches(0)
    for spike_chunk in range(1, SPIKE_CHUNKS):  # a spike elsewhere: the mutation changes nothing
        _spike_matches(spike_chunk)


@pytest.mark.metal
def test_drafter_attention_runs_the_kernel(metal_backend, monkeypatch):
    """A drafter with a sliding and a full layer gives the same logits with kernels on and off."""
    from tiny import make_drafter, prompt_ids, target

    calls = []
    kernel = ba.block_attention_metal
    monkeypatch.setattr(ba, "block_attention_metal", lambda *a, **kw: calls.append(kw["window"]) or kernel(*a, **kw))

    drafter, t = make_drafter(target("qwen3"), block_size=4, head_dim=64, sliding_window=5,
                              layer_types=["sliding_attention", "full_attention"])
    ids = mx.array(prompt_ids(9, seed=2), dtype=mx.int32)[None]
    block = mx.array([[3] + [drafter.config.mask_token_id] * 3], dtype=mx.int32)
    logits = []
    for on in (True, False):
        with kernels_enabled(on):
            cache = drafter.make_cache()
            drafter.append_context(t(ids)[1], cache)
            logits.append(drafter(block, cache))
    assert calls == [5, None]  # the sliding layer, then the full one; none with kernels off
    _check(logits[0], logits[1], mx.float32)


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @pytest.mark.metal
    @settings(max_examples=12, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(group=st.sampled_from([1, 2, 4, 8]), Hkv=st.integers(1, 2), B=st.integers(1, ba.MAX_ROWS),
           D=st.sampled_from(ba.HEAD_DIMS), n_ctx=st.integers(0, 70), window=st.none() | st.integers(1, 40),
           causal=st.booleans(), chunk=st.none() | st.integers(4, 40))
    def test_property_kernel_matches_reference(metal_backend, group, Hkv, B, D, n_ctx, window, causal, chunk):
        q, k, v, ck, cv = _inputs(group * Hkv, Hkv, B, D, n_ctx, mx.float32, seed=n_ctx)
        kw = dict(scale=D**-0.5, window=window, causal=causal)
        _check(ba.block_attention_metal(q, k, v, ck, cv, chunk=chunk, **kw),
               ba.block_attention_reference(q, k, v, ck, cv, **kw), mx.float32)
