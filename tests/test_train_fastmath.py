"""The training step's exp, log-sum-exp and SiLU (train/fastmath.py) against MLX's own, values and
gradients, including the masked (-inf) entries the block attention relies on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.train import fastmath


def _x(shape, scale, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


def test_exp_matches_float64_and_is_exact_at_the_ends():
    x = mx.concatenate([mx.linspace(-86.9, 87.9, 20001), mx.array([-mx.inf, -1e30, -87.5, 0.0])])
    y = np.array(fastmath.exp(x))
    ref = np.exp(np.array(x, dtype=np.float64))
    finite = ref > 1e-37  # float32 normal range
    assert np.max(np.abs(y[finite] - ref[finite]) / ref[finite]) < 3e-7  # mx.exp itself is within ~4e-6
    assert y[-4:].tolist() == [0.0, 0.0, 0.0, 1.0]  # exp(-inf) = 0: masked attention scores get no weight


def test_exp_gradient_and_masked_entries():
    x = mx.where(mx.arange(40) % 7 == 3, -mx.inf, _x((4, 6, 40), 5))
    w = _x((4, 6, 40), 1, seed=1)
    g = mx.grad(lambda x: (fastmath.exp(x) * w).sum())(x)
    assert mx.allclose(g, mx.grad(lambda x: (mx.exp(x) * w).sum())(x), rtol=1e-6, atol=1e-7).item()
    assert (g[..., 3] == 0).all().item()  # a masked score gets no gradient


def test_lse_softmax_matches_mlx():
    x = _x((3, 5, 300), 8)
    lse, p = fastmath.lse_softmax(x)
    assert mx.allclose(lse, mx.logsumexp(x, axis=-1), rtol=1e-6).item()
    assert mx.allclose(p, mx.softmax(x, axis=-1), atol=1e-7).item()


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_silu_and_its_gradient_match_mlx(scale):
    x = _x((5, 333), scale)
    w = _x((5, 333), 1, seed=2)
    assert mx.allclose(fastmath.silu(x), x * mx.sigmoid(x), rtol=1e-6, atol=1e-7).item()
    mine = mx.compile(mx.grad(lambda x: (fastmath.silu(x) * w).sum()))
    ref = mx.grad(lambda x: (x * mx.sigmoid(x) * w).sum())
    assert mx.allclose(mine(x), ref(x), rtol=1e-5, atol=1e-6).item()


def test_other_dtypes_use_mlx():
    x = _x((8,), 3).astype(mx.float16)
    assert fastmath.exp(x).dtype == mx.float16
    assert mx.allclose(fastmath.exp(x), mx.exp(x)).item()
