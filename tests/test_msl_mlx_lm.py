"""Fidelity of the MSL emulator on kernels it was not written for: mlx-lm's own production Metal kernels.

mlx-lm builds its fused kernels (mlx_lm/kernels/, and the GatedDeltaNet kernels of models/gated_delta.py) with
mx.fast.metal_kernel at import. Reloading those modules with the emulator standing in for mx.fast.metal_kernel
(and Metal reported present) runs their exact sources and call arguments here; they must run without a fault (no
false alarm on correct code: whole SIMD groups returning early, alternating threadgroup buffers instead of a
second barrier, strided inputs) and match pure-MLX references. Afterwards the modules are rebuilt as they were.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from msl import emulator

pytestmark = pytest.mark.skipif(not emulator.supported(), reason="the MSL emulator needs Linux and g++")
pytest.importorskip("mlx_lm.kernels", reason="this mlx-lm has no fused kernels")

MODULES = ["qk_norm_rope", "expert_routing", "rms_norm_sigmoid_gate", "norm_add_norm"]


@pytest.fixture(scope="module")
def kernels():
    with emulator.rebuilt([f"mlx_lm.kernels.{name}" for name in MODULES]) as modules:
        yield dict(zip(MODULES, modules))


@pytest.fixture(scope="module")
def gated_delta():
    with emulator.rebuilt(["mlx_lm.models.gated_delta"]) as (module,):
        yield module


def rms(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def test_qk_norm_rope(kernels):
    n, hq, hk, d = 5, 4, 2, 64
    qkvg = mx.random.normal((1, n, 2 * (hq + hk) * d), key=mx.random.key(0))
    q, k = kernels["qk_norm_rope"].qk_norm_rope(qkvg, n_heads=hq, n_kv_heads=hk, head_dim=d, eps=1e-6,
                                                 query_scale=0.125, rope_base=10000.0, offset=7)
    heads = rms(qkvg[..., :(hq + hk) * d].reshape(1, n, hq + hk, d), 1e-6)

    def rope(x):  # x: [1, n, heads, d]
        return mx.fast.rope(x.transpose(0, 2, 1, 3), d, traditional=True, base=10000.0, scale=1.0,
                            offset=7).transpose(0, 2, 1, 3)

    np.testing.assert_allclose(np.array(q), np.array(rope(heads[:, :, :hq] * 0.125)), atol=1e-5)
    np.testing.assert_allclose(np.array(k), np.array(rope(heads[:, :, hq:])), atol=1e-5)


def test_expert_routing_with_simd_max_and_min(kernels):
    e, top_k = 40, 4
    logits = mx.random.normal((6, e), key=mx.random.key(1))
    bias = mx.random.normal((e,), key=mx.random.key(2)) * 0.1
    inds, weights = kernels["expert_routing"].expert_routing(logits, bias, top_k=top_k, multiplier=1.0,
                                                             score_eps=1e-20, route_scale=2.5)
    score = 1 / (1 + np.exp(-np.array(logits)))
    top = np.argsort(-(score + np.array(bias)), axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(score, top, 1)
    np.testing.assert_array_equal(np.array(inds), top)
    np.testing.assert_allclose(np.array(weights), chosen / chosen.sum(1, keepdims=True) * 2.5, rtol=1e-5)


def test_rms_norm_sigmoid_gate_reads_strides(kernels):
    b, h, l, d = 2, 3, 4, 64
    x = mx.random.normal((b, l, h, d), key=mx.random.key(3)).transpose(0, 2, 1, 3)  # a strided [B, H, L, D]
    gate = mx.random.normal((b, l, h * d), key=mx.random.key(4))
    out = kernels["rms_norm_sigmoid_gate"].rms_norm_sigmoid_gate(x, gate, eps=1e-6)
    want = (rms(x.transpose(0, 2, 1, 3), 1e-6) * mx.sigmoid(gate.reshape(b, l, h, d))).reshape(b, l, h * d)
    np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-5)


@pytest.mark.parametrize("dim", [64, 1000])  # one SIMD group; three, with a threadgroup sum across them
def test_pre_norm_with_threadgroup_sums(kernels, dim):
    norm = nn.RMSNorm(dim, eps=1e-5)
    norm.weight = mx.random.normal((dim,), key=mx.random.key(5))
    stream = mx.random.normal((3, dim), key=mx.random.key(6))
    out = kernels["norm_add_norm"].pre_norm(stream, norm, dtype=mx.float32)
    np.testing.assert_allclose(np.array(out), np.array(mx.fast.rms_norm(stream, norm.weight, 1e-5)), atol=1e-5)


@pytest.mark.parametrize("contract", ["off", "fast"])  # multiply-adds never fused; fused wherever g++ can
def test_gated_delta_kernels(gated_delta, contract):
    with emulator.contraction(contract):
        _gated_delta_kernels(gated_delta)


def _gated_delta_kernels(gated_delta):
    b, t, hk, hv, dk, dv = 1, 3, 1, 2, 128, 16  # Dk = 128 with a scalar gate takes the packed kernel
    key = iter(mx.random.split(mx.random.key(7), 8))
    q = mx.random.normal((b, t, hk, dk), key=next(key)) * 0.1
    k = mx.random.normal((b, t, hk, dk), key=next(key)) * 0.1
    v = mx.random.normal((b, t, hv, dv), key=next(key))
    g = mx.exp(-mx.random.uniform(shape=(b, t, hv), key=next(key)))
    g_vec = mx.exp(-mx.random.uniform(shape=(b, t, hv, dk), key=next(key)))
    beta = mx.sigmoid(mx.random.normal((b, t, hv), key=next(key)))
    state = mx.random.normal((b, hv, dv, dk), key=next(key)) * 0.1
    mask = mx.array([[True, False, True]])

    def check(kernel, gate, mask=None):
        y, s = kernel(q, k, v, gate, beta, state, mask)
        y_ref, s_ref = gated_delta.gated_delta_ops(q, k, v, gate, beta, state, mask)
        keep = np.ones(t, bool) if mask is None else np.array(mask[0])  # a masked step's output is unused
        np.testing.assert_allclose(np.array(y)[:, keep], np.array(y_ref)[:, keep], atol=1e-6)
        np.testing.assert_allclose(np.array(s), np.array(s_ref), atol=1e-6)
        return y, s

    packed = check(gated_delta.gated_delta_kernel, g)
    check(gated_delta.gated_delta_kernel_unpacked, g)
    check(gated_delta.gated_delta_kernel, g_vec)
    check(gated_delta.gated_delta_kernel, g, mask)
    # mlx-lm's contract: the packed kernel equals its explicit-tree comparator bit for bit (simd_shuffle_xor)
    tree = gated_delta.gated_delta_kernel_xtree(q, k, v, g, beta, state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(packed, tree))
