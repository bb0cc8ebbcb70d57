"""The layer walk's attention on MLX's CPU backend (`targets/attention.py`: float32 on the host through NumPy,
`targets/host_attention.py`, else the fused exponent) against MLX's own `mx.fast.scaled_dot_product_attention`:
every mask form, grouped-query heads, row counts, batches, dtypes, both float32 paths; the fused exponent; the
host path inside `mx.compile`; what it hands to mlx-lm; and that the walk routes a lone chain through it only on
the CPU path."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.targets import attention as attn_mod
from dflash_mlx.targets import host_attention
from dflash_mlx.targets.attention import attention, shifted_exp, uses_own


def _masks(rows: int, length: int, heads: int):
    keep_first = mx.arange(length)[None] == 0  # every row sees a key: no all-masked row (NaN in both)
    yield None
    yield "causal"
    yield (mx.random.uniform(shape=(rows, length)) > 0.4) | keep_first
    yield (mx.random.uniform(shape=(1, heads, rows, length)) > 0.4) | keep_first
    yield mx.random.normal((1, 1, rows, length))


@pytest.fixture(params=["host", "fused"])
def path(request, monkeypatch):
    """Float32 attention on the host through NumPy (here over caches of any length), or through MLX with the fused
    exponent."""
    monkeypatch.setattr(attn_mod, "HOST", request.param == "host")
    monkeypatch.setattr(host_attention, "MIN_CACHE", 0)
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_matches_mlx_attention_in_float32(heads, kv_heads, rows, path):
    mx.random.seed(rows * 100 + heads)
    for length in (rows, rows + 37, 700):
        batch = 2 if rows == 5 else 1
        q = mx.random.normal((batch, heads, rows, 32))
        k, v = mx.random.normal((batch, kv_heads, length, 32)), mx.random.normal((batch, kv_heads, length, 32))
        for mask in _masks(rows, length, heads):
            ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
            out = attention(q, k, v, None, 0.3, mask)
            err = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
            assert err < 5e-6, (length, None if mask is None else getattr(mask, "shape", mask), err)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_matches_mlx_attention_in_half_precision(dtype):
    mx.random.seed(3)
    q = mx.random.normal((1, 8, 16, 64)).astype(dtype)
    k, v = (mx.random.normal((1, 2, 300, 64)).astype(dtype) for _ in range(2))
    for mask in ("causal", None):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        out = attention(q, k, v, None, 0.125, mask)
        assert out.dtype == dtype
        tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
        assert mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item() < tol


def test_masked_keys_weigh_exactly_nothing(path):
    """A masked key's value, however large, leaves no trace (the exponent of -inf is exactly 0)."""
    mx.random.seed(5)
    q, k = mx.random.normal((1, 4, 3, 16)), mx.random.normal((1, 4, 50, 16))
    v = mx.random.normal((1, 4, 50, 16))
    mask = mx.ones((3, 50), dtype=mx.bool_)
    mask[:, 10:20] = False
    hidden = (mx.arange(50)[:, None] >= 10) & (mx.arange(50)[:, None] < 20)
    loud = mx.where(hidden, 1e30, v)
    base, noisy = attention(q, k, v, None, 0.25, mask), attention(q, k, loud, None, 0.25, mask)
    assert mx.array_equal(base, noisy).item()


def test_keys_viewed_in_a_larger_buffer_and_a_half_precision_additive_mask(path):
    """A cache's keys are a view of its buffer (the first `offset` positions); an additive mask may be bfloat16."""
    mx.random.seed(9)
    q = mx.random.normal((1, 6, 4, 16))
    buffer_k, buffer_v = mx.random.normal((1, 3, 256, 16)), mx.random.normal((1, 3, 256, 16))
    k, v = buffer_k[:, :, :90], buffer_v[:, :, :90]
    mask = mx.random.normal((1, 1, 4, 90)).astype(mx.bfloat16)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask.astype(mx.float32))
    out = attention(q, k, v, None, 0.5, mask)
    assert out.dtype == mx.float32
    assert (mx.abs(out - ref).max() / mx.abs(ref).max()).item() < 5e-6


@pytest.mark.parametrize("heads,kv_heads,dim,past", [(4, 2, 16, 30), (14, 2, 64, 300), (8, 8, 32, 1000)])
def test_host_rows_do_not_depend_on_the_pass_they_are_in(heads, kv_heads, dim, past, monkeypatch):
    """A verify pass of W rows that commits k tokens must leave what a pass of those k tokens would: on the host
    path a row's output is bit for bit the same whatever rows follow it, under the causal mask and under a tree's
    boolean mask that hides other branches' keys (rollback exactness rests on it)."""
    monkeypatch.setattr(host_attention, "MIN_CACHE", 0)
    mx.random.seed(past + heads)
    q = mx.random.normal((1, heads, 16, dim))
    k, v = mx.random.normal((1, kv_heads, past + 16, dim)), mx.random.normal((1, kv_heads, past + 16, dim))
    full = {w: attention(q[:, :, :w], k[:, :, : past + w], v[:, :, : past + w], None, 0.3, "causal")
            for w in (1, 2, 3, 5, 16)}
    for w, out in full.items():
        for shorter in (x for x in full if x < w):
            assert mx.array_equal(out[:, :, :shorter], full[shorter]).item(), (w, shorter)
    # A tree: node 1 a sibling of node 0's child 2; the chain 0 -> 2 -> 3 sees what the tree's path sees.
    sees = np.ones((4, past + 4), dtype=bool)
    sees[:, past:] = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    tk = mx.concatenate([k[:, :, :past], k[:, :, past + 4 : past + 8]], axis=2)
    tv = mx.concatenate([v[:, :, :past], v[:, :, past + 4 : past + 8]], axis=2)
    tree = attention(q[:, :, 4:8], tk, tv, None, 0.3, mx.array(sees))
    path = [0, 2, 3]
    ck = mx.concatenate([k[:, :, :past], tk[:, :, [past + i for i in path]]], axis=2)
    cv = mx.concatenate([v[:, :, :past], tv[:, :, [past + i for i in path]]], axis=2)
    chain = attention(q[:, :, [4 + i for i in path]], ck, cv, None, 0.3, "causal")
    assert mx.array_equal(tree[:, :, path], chain).item()


def test_float32_passes_over_a_long_cache_go_to_the_host(monkeypatch):
    """The host path where it pays: float32, at least `MIN_CACHE` cached tokens; the fused exponent elsewhere."""
    calls = []
    real = host_attention.attention
    monkeypatch.setattr(host_attention, "attention", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    n = host_attention.MIN_CACHE
    for length, dtype in ((n + 4, mx.float32), (n + 3, mx.float32), (n + 4, mx.bfloat16)):
        q = mx.zeros((1, 4, 4, 16), dtype=dtype)
        kv = mx.zeros((1, 2, length, 16), dtype=dtype)
        mx.eval(attention(q, kv, kv, None, 0.25, "causal"))
    assert calls == [n + 4]


def test_host_path_inside_compile_computes_in_mlx():
    """Nothing may be evaluated inside `mx.compile`: there the host path steps aside and MLX computes it."""
    mx.random.seed(13)
    q, k, v = mx.random.normal((1, 4, 3, 16)), mx.random.normal((1, 2, 30, 16)), mx.random.normal((1, 2, 30, 16))
    calls = []

    def traced(q, k, v):
        calls.append(host_attention.attention(q, k, v, 0.25, "causal"))
        return attention(q, k, v, None, 0.25, "causal")

    out = mx.compile(traced)(q, k, v)
    assert calls == [None]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert (mx.abs(out - ref).max() / mx.abs(ref).max()).item() < 5e-6


def test_fused_exponent_is_within_a_few_ulps_and_zero_below_range():
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 200001), -mx.random.uniform(shape=(100000,)) * 20])
    got, want = np.array(shifted_exp(x, mx.array(0.0))), np.exp(np.array(x, dtype=np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 4e-7, rel.max()
    edge = shifted_exp(mx.array([-math.inf, -1e4, -90.0, -88.0]), mx.array(0.0))
    assert np.array(edge).tolist() == [0.0, 0.0, 0.0, 0.0]
    # The shift: exp(s - m), s <= m.
    s = mx.array([[1.0, 3.0, 2.0]])
    assert np.allclose(np.array(shifted_exp(s, mx.array(3.0))), np.exp([-2.0, 0.0, -1.0]), rtol=1e-6)


def test_compiled_kernel_keeps_a_bounded_number_of_shapes():
    fused = attn_mod._Fused()
    shift = mx.zeros((1, 1))
    for n in range(1, 3 * fused.MAX_SHAPES):
        out = fused(mx.zeros((1, n)), shift)
        assert len(fused._shapes) <= fused.MAX_SHAPES
    assert np.array(out).tolist() == [[1.0] * (3 * fused.MAX_SHAPES - 1)]


def test_what_goes_to_mlx_lm():
    q = mx.zeros((1, 4, 8, 16))

    class Quantized:
        bits, group_size = 4, 64

    assert uses_own(q)
    assert not uses_own(q, cache=Quantized())  # mlx-lm's quantized attention
    assert not uses_own(q, sinks=mx.zeros((4,)))
    assert not uses_own(mx.zeros((1, 4, attn_mod.MAX_ROWS + 1, 16)))  # a prefill chunk: MLX's own call
    if mx.metal.is_available():
        with mx.stream(mx.gpu):
            assert not uses_own(q)  # a GPU: MLX's fused kernel


def test_switched_off_it_is_mlx_lm_call(monkeypatch):
    monkeypatch.setattr(attn_mod, "ENABLED", False)
    q, k, v = mx.random.normal((1, 4, 6, 16)), mx.random.normal((1, 2, 20, 16)), mx.random.normal((1, 2, 20, 16))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.array_equal(attention(q, k, v, None, 0.25, "causal"), ref).item()


def test_a_lone_chain_takes_the_restated_attention_only_when_short():
    from dflash_mlx.targets.walk import Chain

    assert Chain(mx.zeros((1, 16), dtype=mx.int32), None).split_alone
    assert not Chain(mx.zeros((1, attn_mod.MAX_ROWS + 1), dtype=mx.int32), None).split_alone


def test_another_thread_gets_a_kernel_of_its_own(path):
    """A server prepares its target on one thread and decodes on another."""
    import threading

    mx.random.seed(11)
    q, k, v = mx.random.normal((1, 8, 5, 16)), mx.random.normal((1, 2, 40, 16)), mx.random.normal((1, 2, 40, 16))
    here = attention(q, k, v, None, 0.25, "causal")
    mx.eval(here)
    got = {}

    def worker():
        try:
            got["out"] = attention(q, k, v, None, 0.25, "causal")
            mx.eval(got["out"])
        except Exception as exc:  # noqa: BLE001  (reported below)
            got["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert "error" not in got, got.get("error")
    assert mx.array_equal(got["out"], here).item()
