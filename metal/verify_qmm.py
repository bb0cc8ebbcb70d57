"""Verify-width quantized matmul: x [.., M, K] @ dequantize(w).T for M = 2..16 rows on 4/8-bit affine weights.

A verify block multiplies 2..16 rows by every weight matrix of a quantized target; the stock path is built for
one row (decode) or for many (prefill). The kernel (`verify_qmm.metal`) reads each packed weight once for all
rows. The reference is `mx.quantized_matmul` itself. `VerifyQuantizedLinear` is mlx's `QuantizedLinear` with
the dispatcher in its call (same parameters, same results up to summation order).

`VerifyQmmScope(model)` routes a model's `QuantizedLinear` layers through the dispatcher only inside
`with scope:` (the target's own passes): the layers keep their identity and get their class back on exit, so the
user's model, called by mlx-lm or anything else, runs mlx's stock layers. `use_verify_qmm(model)` is the explicit,
permanent opt-in: it puts `VerifyQuantizedLinear` copies in place of the layers, as `nn.quantize` swaps `Linear`.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..errors import DFlashError
from .kernel_file import kernels_on, load_kernel_file

MIN_ROWS, MAX_ROWS = 2, 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
COLS_PER_SIMDGROUP = 4  # DFLASH_QMM_COLS in the source
SIMDGROUPS = 2


def verify_qmm_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                         bits: int) -> mx.array:
    """x [..., K] @ dequantize(w, scales, biases).T -> [..., N] (mlx's affine quantization, transposed weight)."""
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=bits)


def check_shapes(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], *, group_size: int,
                 bits: int) -> None:
    """Raise DFlashError unless x [..., K] fits an affine-quantized weight: w [N, K * bits / 32], scales (and biases)
    [N, K / group_size]. The kernel trusts these shapes: a mismatched K or group size would read out of bounds."""
    if w.ndim != 2 or x.ndim < 1:
        return  # no matrix of this kind: mx.quantized_matmul says what is wrong
    K, k_w = x.shape[-1], w.shape[1] * 32 // bits
    problems = []
    if K != k_w:
        problems.append(f"the input has K = {K}, the {bits}-bit weight K = {k_w}")
    if scales.ndim != 2 or scales.shape[0] != w.shape[0] or scales.shape[1] * group_size != k_w:
        problems.append(f"scales of shape {tuple(scales.shape)} do not make groups of {group_size} of its {k_w} "
                        f"values per row")
    if biases is not None and biases.shape != scales.shape:
        problems.append(f"biases of shape {tuple(biases.shape)} differ from the scales")
    if problems:
        raise DFlashError(f"quantized matmul: input of shape {tuple(x.shape)} does not match the weight of shape "
                          f"{tuple(w.shape)}: " + "; ".join(problems))


@functools.lru_cache(maxsize=None)
def _kernel():
    from . import kernel  # the factory: mx.fast.metal_kernel on a Mac, the emulator in tests

    src = load_kernel_file("verify_qmm.metal")
    return kernel(
        name="dflash_verify_qmm",
        input_names=["x", "w", "scales", "biases", "group_size", "bits"],
        output_names=["y"],
        source=src.bodies["dflash_verify_qmm"],
        header=src.header,
    )


def verify_qmm_metal(x, w, scales, biases, *, group_size, bits):
    """The kernel; same arguments and result as `verify_qmm_reference` (DFlashError for mismatched shapes)."""
    check_shapes(x, w, scales, biases, group_size=group_size, bits=bits)
    K, N = x.shape[-1], w.shape[0]
    rows = x.reshape(-1, K)
    (y,) = _kernel()(
        inputs=[rows, w, scales, biases, group_size, bits],
        template=[("T", x.dtype)],
        grid=(32, -(-N // COLS_PER_SIMDGROUP), 1),
        threadgroup=(32, SIMDGROUPS, 1),
        output_shapes=[(rows.shape[0], N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)


def kernel_supports(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
                    bits: int, mode: str = "affine") -> bool:
    """What the kernel handles: 2..16 rows, affine 4/8-bit weights, group 32/64/128, float activations."""
    if mode != "affine" or biases is None or bits not in BITS or group_size not in GROUP_SIZES:
        return False
    if x.dtype not in DTYPES or w.dtype != mx.uint32 or w.ndim != 2 or x.ndim < 1:
        return False
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    return MIN_ROWS <= rows <= MAX_ROWS and scales.dtype == biases.dtype


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """The dispatcher: the kernel for verify-width inputs where Metal kernels are on, else `mx.quantized_matmul`.
    Affine shapes are checked first (`check_shapes`), so both paths refuse a mismatch with the same DFlashError."""
    if mode == "affine":
        check_shapes(x, w, scales, biases, group_size=group_size, bits=bits)
    if kernels_on() and kernel_supports(x, w, scales, biases, group_size, bits, mode):
        return verify_qmm_metal(x, w, scales, biases, group_size=group_size, bits=bits)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=bits, mode=mode)


class VerifyQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose matmul goes through `quantized_matmul` (the kernel for 2..16 rows)."""

    @classmethod
    def like(cls, layer: nn.QuantizedLinear) -> "VerifyQuantizedLinear":
        """The same layer (same arrays, same settings), with this class's call."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        dict.update(new, layer)  # the parameters: a module is a dict of its arrays and submodules
        return new

    def __call__(self, x):
        x = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                             bits=self.bits, mode=self.mode)
        if "bias" in self:
            x = x + self["bias"]
        return x


def use_verify_qmm(model: nn.Module) -> int:
    """Route every `nn.QuantizedLinear` of `model` through the dispatcher; returns how many layers it covers."""
    count = 0

    def swap(_path, module):
        nonlocal count
        if type(module) is nn.QuantizedLinear:
            count += 1
            return VerifyQuantizedLinear.like(module)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return count


class VerifyQmmScope:
    """`with scope:` runs `model`'s stock `nn.QuantizedLinear` layers as `VerifyQuantizedLinear` (the same objects,
    their class switched), and gives them their own class back on exit. A no-op where kernels are off (the CPU).

    Re-entrant (nested passes, e.g. the head inside a forward). Switching a class is a pointer write per layer, so
    entering per pass costs next to nothing; MLX builds its graph during the call, so the kernel choice is made
    inside the block even though the graph is evaluated later.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers: Optional[List[nn.QuantizedLinear]] = None  # found on first use where kernels are on
        self._switched: List[nn.QuantizedLinear] = []
        self._depth = 0

    def __enter__(self) -> "VerifyQmmScope":
        if self._depth == 0 and kernels_on():
            if self._layers is None:
                self._layers = [m for m in self.model.modules() if type(m) is nn.QuantizedLinear]
            # Only layers still stock: one the user swapped meanwhile is theirs to keep.
            self._switched = [m for m in self._layers if type(m) is nn.QuantizedLinear]
            for m in self._switched:
                m.__class__ = VerifyQuantizedLinear
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            switched, self._switched = self._switched, []
            for m in switched:
                m.__class__ = nn.QuantizedLinear
