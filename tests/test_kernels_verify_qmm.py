"""Verify-width quantized matmul (dflash_mlx.metal.verify_qmm): kernel against `mx.quantized_matmul` for 2..16 rows,
4/8 bits, groups of 32/64/128, three dtypes, column counts and depths that fill no tile; and the layer swap that
routes a quantized target's linears through the dispatcher changes nothing where the kernel is off."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_mlx.metal import verify_qmm as vq
from dflash_mlx.targets import TargetModel


from dflash_mlx.errors import DFlashError
from kernel_cases import DTYPES, kernels_enabled, metal_backend  # noqa: F401  (the fixture: both contractions)
# (M, K, N, group_size, bits): K with a partial last sweep of the 32 lanes, N not a multiple of 4 columns.
CASES = [(2, 384, 10, 64, 4), (16, 256, 7, 32, 8), (5, 384, 9, 128, 4), (3, 192, 5, 32, 4), (9, 128, 6, 128, 8)]


def _case_id(case):
    M, K, N, gs, bits = case
    return f"M{M}-K{K}-N{N}-g{gs}-{bits}bit"


def _quantized(M, K, N, group_size, bits, dtype, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((M, K)).astype(dtype)
    w, scales, biases = mx.quantize(mx.random.normal((N, K)) / K**0.5, group_size=group_size, bits=bits)
    return x, w, scales.astype(dtype), biases.astype(dtype)


def test_layer_swap_is_transparent_without_kernels(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_NO_METAL", "1")
    model = nn.Sequential(nn.QuantizedLinear(64, 64, bias=True, group_size=32, bits=4), nn.Linear(64, 64),
                          nn.QuantizedLinear(64, 8, group_size=64, bits=8))
    x = mx.random.normal((1, 5, 64))
    before = model(x)
    assert vq.use_verify_qmm(model) == 2
    assert [type(m).__name__ for m in model.layers] == ["VerifyQuantizedLinear", "Linear", "VerifyQuantizedLinear"]
    assert isinstance(model.layers[0], nn.QuantizedLinear) and model.layers[0].bits == 4
    assert mx.array_equal(model(x), before).item()


def test_quantized_target_is_untouched_without_kernels(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_NO_METAL", "1")
    from tiny import build_target

    model = build_target("qwen3")
    nn.quantize(model, group_size=32, bits=4)
    TargetModel(model)
    assert not any(isinstance(m, vq.VerifyQuantizedLinear) for _, m in model.named_modules())


def test_dispatcher_takes_only_verify_widths():
    x, w, s, b = _quantized(17, 128, 8, 64, 4, mx.float32)
    assert [vq.kernel_supports(x[:m], w, s, b, 64, 4) for m in (1, 2, 16, 17)] == [False, True, True, False]
    assert vq.kernel_supports(x[None, :5], w, s, b, 64, 4)  # [1, 5, K], as a layer sees a verify block
    assert not vq.kernel_supports(x[:2], w, s, b, 64, 4, mode="mxfp4")
    assert not vq.kernel_supports(x[:2], w, s, b, 64, 3)


def _mismatched(wrong: str):
    """(x, w, scales, biases, group_size) with x's K or the group size not the weight's."""
    x, w, s, b = _quantized(4, 384, 8, 64, 4, mx.float32)
    if wrong == "K":
        return x[:, :256], w, s, b, 64
    return x, w, s, b, 32  # the weight is quantized in groups of 64


def _raises_one_error(x, w, s, b, gs):
    with pytest.raises(DFlashError) as err:
        mx.eval(vq.quantized_matmul(x, w, s, b, group_size=gs, bits=4))
    message = str(err.value)
    assert str(tuple(x.shape)) in message and str(tuple(w.shape)) in message, message


@pytest.mark.parametrize("wrong", ["K", "group_size"])
def test_dispatcher_checks_shapes_without_kernels(wrong):
    with kernels_enabled(False):
        _raises_one_error(*_mismatched(wrong))


@pytest.mark.metal
@pytest.mark.parametrize("wrong", ["K", "group_size"])
def test_dispatcher_checks_shapes_before_the_kernel(metal_backend, wrong):
    """The kernel would read x or the scales out of bounds: the dispatcher refuses first, with the same error."""
    x, w, s, b, gs = _mismatched(wrong)
    assert vq.kernel_supports(x, w, s, b, gs, 4)  # the shape is one the kernel would take
    _raises_one_error(x, w, s, b, gs)
    with pytest.raises(DFlashError):
        vq.verify_qmm_metal(x, w, s, b, group_size=gs, bits=4)


# -- kernel (Metal on a Mac, the MSL emulator elsewhere) -----------------------------------------------------------
_TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_quantized_matmul(metal_backend, case, dtype):
    M, K, N, gs, bits = case
    dt = DTYPES[dtype]
    x, w, s, b = _quantized(M, K, N, gs, bits, dt, seed=1)
    y = vq.verify_qmm_metal(x, w, s, b, group_size=gs, bits=bits)
    # Against the float32 reference on the same (rounded) activations and scales: the kernel sums in float32.
    ref = vq.verify_qmm_reference(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32),
                                  group_size=gs, bits=bits)
    assert y.shape == (M, N) and y.dtype == dt
    err = mx.abs(y.astype(mx.float32) - ref).max().item()
    assert err <= _TOL[dt] * max(1.0, mx.abs(ref).max().item()), f"max error {err:.3g}"


@pytest.mark.metal
def test_quantized_target_verify_through_the_kernel(metal_backend, monkeypatch):
    """A 4-bit tiny target: a 5-token verify with its linears on the kernel matches mlx's own quantized matmul;
    the kernel runs inside the target's pass only, and the model keeps mlx's own layers."""
    from tiny import build_target

    model = build_target("qwen3")
    nn.quantize(model, group_size=32, bits=4)
    ids = mx.array([[5, 17, 3, 42, 8, 11]], dtype=mx.int32)
    with kernels_enabled(False):
        ref = TargetModel(model)(ids)[0]
    calls = []
    kernel = vq.verify_qmm_metal
    monkeypatch.setattr(vq, "verify_qmm_metal", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with kernels_enabled(True):
        t = TargetModel(model)
        out = t(ids)[0]
        assert calls, "the target's verify pass did not take the kernel"
        assert not any(isinstance(m, vq.VerifyQuantizedLinear) for _, m in model.named_modules())
    err = mx.abs(out - ref).max().item()
    assert err <= 1e-4 * max(1.0, mx.abs(ref).max().item()), f"max logit error {err:.3g}"


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @pytest.mark.metal
    @settings(max_examples=12, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(M=st.integers(vq.MIN_ROWS, vq.MAX_ROWS), groups=st.integers(1, 6), N=st.integers(1, 13),
           group_size=st.sampled_from(vq.GROUP_SIZES), bits=st.sampled_from(vq.BITS))
    def test_property_kernel_matches_quantized_matmul(metal_backend, M, groups, N, group_size, bits):
        x, w, s, b = _quantized(M, groups * group_size, N, group_size, bits, mx.float32, seed=M * N)
        y = vq.verify_qmm_metal(x, w, s, b, group_size=group_size, bits=bits)
        ref = vq.verify_qmm_reference(x, w, s, b, group_size=group_size, bits=bits)
        err = mx.abs(y - ref).max().item()
        assert err <= _TOL[mx.float32] * max(1.0, mx.abs(ref).max().item()), f"max error {err:.3g}"
