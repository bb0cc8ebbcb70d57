"""The MSL emulation harness (tests/msl): kernels run with GPU semantics, as MLX dispatches them.

Each test (marked `metal`) uses the `metal_backend` fixture, so on a Mac it runs unchanged on real Metal and
elsewhere on the emulator; tests/test_msl_faults.py holds the emulator's own checks. Every kernel here compiles
once per machine (cached by hash).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import metal
from msl import emulator

needs_emulator = pytest.mark.skipif(not emulator.supported(), reason="the MSL emulator needs Linux and g++")


# ---- what the kernel sees ----

POSITIONS = metal.kernel(
    name="positions",
    input_names=["scale"],
    output_names=["out"],
    source="""
    uint3 g = thread_position_in_grid;
    uint row = (g.z * threads_per_grid.y + g.y) * threads_per_grid.x + g.x;
    device uint* o = out + row * 12;
    o[0] = g.x; o[1] = g.y; o[2] = g.z;
    o[3] = threadgroup_position_in_grid.x; o[4] = threadgroup_position_in_grid.y;
    o[5] = thread_position_in_threadgroup.x; o[6] = thread_position_in_threadgroup.y;
    o[7] = threads_per_threadgroup.x; o[8] = threads_per_threadgroup.y;
    o[9] = thread_index_in_threadgroup;
    o[10] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
    o[11] = uint(scale * float(threadgroups_per_grid.x));
""",
)


@pytest.mark.metal
def test_thread_attributes_with_partial_edge_threadgroups(metal_backend):
    grid, group = (37, 3, 1), (16, 2, 1)  # edge threadgroups hold 5 columns and 1 row
    (out,) = POSITIONS(inputs=[2.0], grid=grid, threadgroup=group, output_shapes=[(3 * 37, 12)],
                       output_dtypes=[mx.uint32])
    out = np.array(out).reshape(3, 37, 12)
    for y in range(3):
        for x in range(37):
            size = (min(16, 37 - x // 16 * 16), min(2, 3 - y // 2 * 2))
            local = (x % 16, y % 2)
            index = local[1] * size[0] + local[0]
            want = [x, y, 0, x // 16, y // 2, *local, *size, index, index // 32 * 100 + index % 32, 2 * 3]
            assert out[y, x].tolist() == want, (x, y)


EXP = metal.kernel(
    name="exp_elementwise",
    input_names=["inp"],
    output_names=["out"],
    source="""
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
""",
)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_mlx_docs_example(metal_backend, dtype):
    a = mx.random.normal(shape=(4, 25), key=mx.random.key(0)).astype(dtype)
    (b,) = EXP(inputs=[a], template=[("T", dtype)], grid=(a.size, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[a.shape], output_dtypes=[dtype])
    assert b.dtype == dtype
    assert mx.allclose(b, mx.exp(a), rtol=1e-3 if dtype == mx.float16 else 1e-6).item()


STRIDED = metal.kernel(
    name="strided_copy",
    input_names=["inp"],
    output_names=["out"],
    ensure_row_contiguous=False,
    source="""
    uint elem = thread_position_in_grid.x;
    // int64_t offsets: with a uint index a negative stride would wrap (on a GPU as here)
    out[elem] = inp[elem_to_loc<int64_t>(elem, inp_shape, inp_strides, inp_ndim)];
""",
)


@pytest.mark.metal
def test_strided_inputs_keep_their_strides(metal_backend):  # sliced, transposed, broadcast, reversed
    base = mx.arange(60, dtype=mx.float32).reshape(5, 12)
    for view in (base[:, 2:9:3], base.T, mx.broadcast_to(base[:1, :4], (3, 4)), base[::-2, 1:]):
        (out,) = STRIDED(inputs=[view], grid=(view.size, 1, 1), threadgroup=(64, 1, 1),
                         output_shapes=[view.shape], output_dtypes=[mx.float32])
        np.testing.assert_array_equal(np.array(out), np.array(view))


LANGUAGE = metal.kernel(
    name="language",
    input_names=["x"],
    output_names=["out"],
    source="""
    // Metal idioms the shim must compile: vector types and loads, 2-D threadgroup arrays, half literals,
    // template flags, MLX's Limits, fast:: and precise:: math, as_type, select.
    threadgroup float4 tile[2][4];
    uint t = thread_index_in_threadgroup;
    float4 v = reinterpret_cast<const device float4*>(x)[t];
    tile[t / 4][t % 4] = v * 2.0f + float4(1.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float4 w = tile[(7 - t) / 4][(7 - t) % 4];
    half4 h = half4(w);
    out[t * 8 + 0] = dot(w, float4(1.0f, 0.0f, 0.0f, 0.0f));
    out[t * 8 + 1] = float(h.y);
    out[t * 8 + 2] = FLAG ? metal::clamp(w.z, 0.0f, float(LIM)) : -1.0f;
    out[t * 8 + 3] = float(Limits<half>::finite_max) + float(Limits<int8_t>::min)
                     + float(Limits<bfloat16_t>::min < 0.0f);
    out[t * 8 + 4] = fast::exp(w.w * 0.0f) + precise::sqrt(4.0f);
    out[t * 8 + 5] = as_type<float>(as_type<uint>(w.x));
    out[t * 8 + 6] = float(simd_sum(half(1.0h)));
    out[t * 8 + 7] = select(1.0f, 2.0f, t > 3);
""",
)


@pytest.mark.metal
def test_metal_language_idioms(metal_backend):
    (out,) = LANGUAGE(inputs=[mx.arange(32, dtype=mx.float32)], template=[("FLAG", True), ("LIM", 5)],
                      grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8, 8)], output_dtypes=[mx.float32])
    for t, row in enumerate(np.array(out).tolist()):
        first = 8 * (7 - t) + 1  # tile[7 - t].x = 2 * x[4 * (7 - t)] + 1
        assert row == [first, first + 2, 5, 65504 - 128 + 1, 3, first, 8, 2 if t > 3 else 1], t


# ---- collectives ----

ROW_NORMALIZE = metal.kernel(
    name="row_normalize",
    input_names=["x", "n"],
    output_names=["out"],
    header="#include <metal_stdlib>\nusing namespace metal;\n",
    source="""
    // out = x / sum(x) per row, one threadgroup per row: simd_sum, then SIMD group 0 combines the partials.
    threadgroup float partial[32];
    threadgroup float total;
    uint row = threadgroup_position_in_grid.x;
    uint tid = thread_index_in_threadgroup;
    uint lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
    float acc = 0.0f;
    for (uint i = tid; i < uint(n); i += threads_per_threadgroup.x) {
        acc += float(x[row * n + i]);
    }
    acc = simd_sum(acc);
    if (lane == 0) {
        partial[sg] = acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {  // only this SIMD group runs the next collective before the barrier: that is allowed
        float v = lane < simdgroups_per_threadgroup ? partial[lane] : 0.0f;
        v = simd_sum(v);
        if (lane == 0) {
            total = v;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < uint(n); i += threads_per_threadgroup.x) {
        out[row * n + i] = x[row * n + i] / total;
    }
""",
)


@pytest.mark.metal
def test_reduction_with_simd_sum_and_threadgroup_memory(metal_backend):
    x = mx.random.uniform(shape=(3, 1000), key=mx.random.key(1))
    (out,) = ROW_NORMALIZE(inputs=[x, 1000], grid=(3 * 256, 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[(3, 1000)], output_dtypes=[mx.float32])
    want = np.array(x) / np.array(x).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5)


SIMD_OPS = metal.kernel(
    name="simd_ops",
    input_names=["x"],
    output_names=["out"],
    source="""
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    int v = x[i];
    device int* o = out + i * 9;
    o[0] = simd_shuffle(v, (lane * 7) % 32);
    o[1] = simd_shuffle_down(v, 3);
    o[2] = simd_shuffle_up(v, 5);
    o[3] = simd_shuffle_xor(v, 6);
    o[4] = simd_broadcast(v, 9);
    o[5] = simd_prefix_exclusive_sum(v);
    o[6] = simd_prefix_inclusive_sum(v);
    o[7] = simd_max(v) - simd_min(v);
    o[8] = simd_sum(v);
""",
)


@pytest.mark.metal
def test_simd_shuffles_and_scans(metal_backend):
    v = np.random.default_rng(2).integers(-50, 50, size=64).astype(np.int32)
    (out,) = SIMD_OPS(inputs=[mx.array(v)], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64, 9)],
                      output_dtypes=[mx.int32])
    out = np.array(out)
    for g in range(2):
        s = v[g * 32:(g + 1) * 32]
        for lane in range(32):
            want = [s[lane * 7 % 32], s[lane + 3] if lane + 3 < 32 else s[lane], s[lane - 5] if lane >= 5 else s[lane],
                    s[lane ^ 6], s[9], s[:lane].sum(), s[:lane + 1].sum(), s.max() - s.min(), s.sum()]
            assert out[g * 32 + lane].tolist() == want, lane


MATMUL = metal.kernel(
    name="simdgroup_matmul",
    input_names=["a", "b"],
    output_names=["c"],
    source="""
    // One SIMD group per 8x8 tile of C = A @ B; A is M x K, B is K x N, row-major.
    uint tile_m = threadgroup_position_in_grid.y, tile_n = threadgroup_position_in_grid.x;
    simdgroup_matrix<T, 8, 8> acc = make_filled_simdgroup_matrix<T, 8, 8>(T(0));
    simdgroup_matrix<T, 8, 8> ta, tb;
    for (uint k = 0; k < K; k += 8) {
        simdgroup_load(ta, a, K, ulong2(k, tile_m * 8));
        simdgroup_load(tb, b, N, ulong2(tile_n * 8, k));
        simdgroup_multiply_accumulate(acc, ta, tb, acc);
    }
    simdgroup_store(acc, c, N, ulong2(tile_n * 8, tile_m * 8));
""",
)


@pytest.mark.metal
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 1e-2), (mx.bfloat16, 6e-2)])
def test_simdgroup_matrix_matmul_matches_numpy(metal_backend, dtype, tol):
    m, k, n = 16, 24, 16
    a = mx.random.normal(shape=(m, k), key=mx.random.key(3)).astype(dtype)
    b = mx.random.normal(shape=(k, n), key=mx.random.key(4)).astype(dtype)
    (c,) = MATMUL(inputs=[a, b], template=[("T", dtype), ("K", k), ("N", n)], grid=(32 * n // 8, m // 8, 1),
                  threadgroup=(32, 1, 1), output_shapes=[(m, n)], output_dtypes=[dtype])
    want = np.array(a.astype(mx.float32)) @ np.array(b.astype(mx.float32))
    # the accumulator has the element type: it rounds after each of the K / 8 steps
    np.testing.assert_allclose(np.array(c.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())


FRAGMENT = metal.kernel(
    name="fragment_layout",
    input_names=["m"],
    output_names=["out"],
    source="""
    simdgroup_matrix<float, 8, 8> t;
    simdgroup_load(t, m);
    uint lane = thread_index_in_simdgroup;
    out[lane * 2] = t.thread_elements()[0];
    out[lane * 2 + 1] = t.thread_elements()[1];
""",
)


@pytest.mark.metal
def test_simdgroup_fragment_layout_is_the_one_mlx_steel_assumes(metal_backend):
    (out,) = FRAGMENT(inputs=[mx.arange(64, dtype=mx.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                      output_shapes=[(64,)], output_dtypes=[mx.float32])
    out = np.array(out).reshape(32, 2)
    for lane in range(32):  # BaseMMAFrag<T, 8, 8>::get_coord in mlx/backend/metal/kernels/steel/gemm/mma.h
        qid = lane // 4
        row, col = (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2
        assert out[lane].tolist() == [row * 8 + col, row * 8 + col + 1], lane


# ---- numbers ----

ROUNDING = metal.kernel(
    name="rounding",
    input_names=["x"],
    output_names=["h", "bf", "hsum", "bsum"],
    source="""
    uint i = thread_position_in_grid.x;
    h[i] = half(x[i]);
    bf[i] = bfloat(x[i]);
    half a = half(x[i]);
    hsum[i] = a * a + a;                 // half arithmetic rounds after every operation
    bfloat b = bfloat(x[i]);
    bsum[i] = b * b + b;
""",
)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by bit manipulation."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.metal
def test_half_and_bfloat_round_to_nearest_even(metal_backend):
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F807FFF], np.uint32).view(np.float32)
    half_ties = np.float32(1 + 2.0 ** -11) * np.array([1, 3], np.float32)  # exactly between two halves
    x = np.concatenate([ties, half_ties, np.random.default_rng(5).normal(size=57).astype(np.float32) * 100,
                        np.array([np.inf, -np.inf, 70000.0, 1e-8], np.float32)]).astype(np.float32)
    h, bf, hsum, bsum = ROUNDING(inputs=[mx.array(x)], grid=(x.size, 1, 1), threadgroup=(32, 1, 1),
                                 output_shapes=[x.shape] * 4,
                                 output_dtypes=[mx.float16, mx.bfloat16, mx.float16, mx.bfloat16])
    with np.errstate(over="ignore"):
        a = x.astype(np.float16)
    np.testing.assert_array_equal(np.array(h), a)
    want_bf = bf16_rne(x)
    np.testing.assert_array_equal(np.array(bf.view(mx.uint16)), want_bf)
    mlx_bf = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(np.array(bf.view(mx.uint16)), mlx_bf)
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(np.array(hsum), a * a + a)
        b = bf16_value(want_bf)
        np.testing.assert_array_equal(np.array(bsum.view(mx.uint16)), bf16_rne(bf16_value(bf16_rne(b * b)) + b))


HISTOGRAM = metal.kernel(
    name="histogram",
    input_names=["x"],
    output_names=["counts"],
    atomic_outputs=True,
    source="""
    uint i = thread_position_in_grid.x;
    atomic_fetch_add_explicit(&counts[x[i] % 8], 1, memory_order_relaxed);
""",
)


@pytest.mark.metal
def test_atomic_outputs_with_init_value(metal_backend):
    x = np.random.default_rng(6).integers(0, 100, size=300).astype(np.int32)
    (counts,) = HISTOGRAM(inputs=[mx.array(x)], grid=(300, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(8,)],
                          output_dtypes=[mx.int32], init_value=0)
    np.testing.assert_array_equal(np.array(counts), np.bincount(x % 8, minlength=8))


# ---- the factory ----

@needs_emulator
def test_factory_routes_to_the_installed_backend(monkeypatch):
    if mx.metal.is_available():
        pytest.skip("this machine has Metal: the factory runs it, not the emulator")
    assert metal.available() is False
    a = mx.arange(8, dtype=mx.float32)
    call = dict(inputs=[a], template=[("T", mx.float32)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                output_shapes=[(8,)], output_dtypes=[mx.float32])
    with pytest.raises(RuntimeError, match="Metal"):
        EXP(**call)  # no backend: mx.fast.metal_kernel, which has no Metal here
    with emulator.installed():
        assert metal.available() is True
        monkeypatch.setenv(metal.NO_METAL_ENV, "1")
        assert metal.available() is False  # the switch wins over any backend
        monkeypatch.delenv(metal.NO_METAL_ENV)
        (out,) = EXP(**call)
    assert metal.available() is False
    np.testing.assert_allclose(np.array(out), np.exp(np.arange(8)), rtol=1e-6)


@needs_emulator
@pytest.mark.parametrize("contract", ["off", "fast"])
def test_contraction_flag_sets(contract):
    """Contraction "off" rounds a product before the add; "fast" fuses it into one fma, across statements, where
    g++ can (each flag set compiles and caches objects of its own)."""
    if contract == "fast" and not emulator.fma_contraction_fuses():
        pytest.skip("this CPU has no fused multiply-add for g++ to use")
    fmadd = emulator.metal_kernel(name="contract", input_names=["a", "b", "c"], output_names=["out"], source="""
        uint i = thread_position_in_grid.x;
        float p = a[i] * b[i];
        out[i] = p + c[i];
    """)
    a = mx.array([1 + 2.0**-12], dtype=mx.float32)  # a * a = 1 + 2^-11 + 2^-24, a tie that rounds down to even
    with emulator.contraction(contract):
        (out,) = fmadd(inputs=[a, a, -(1 + 2.0**-11) * mx.ones(1)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                       output_shapes=[(1,)], output_dtypes=[mx.float32])
    assert out.item() == (2.0**-24 if contract == "fast" else 0.0)
    with pytest.raises(ValueError, match="contraction must be one of"):
        with emulator.contraction("on"):
            pass
