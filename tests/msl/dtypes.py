"""MLX dtypes as the MSL emulator moves them: C type names (MLX's get_type_string), raw bits, poison values.

Arrays cross into the compiled kernel as raw bits (numpy unsigned integers of the element's width), which keeps
bfloat16 exact without a numpy bfloat16 type and lets outputs be checked bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# dtype -> (C type in the generated signature, numpy dtype holding its values, or None for bfloat16).
_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", None),
    mx.bool_: ("bool", np.bool_),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
}
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Two poison patterns per width, one per run (forward, reverse): an element that reads back as its run's poison in
# both runs was never written. Float patterns are NaNs with a payload.
_FLOAT_POISON = {mx.float32: (0x7FC15A5A, 0x7FC2A5A5), mx.float16: (0x7E5A, 0x7EA5), mx.bfloat16: (0x7FDA, 0x7FE5)}
_INT_POISON = {1: (0x5A, 0xA5), 2: (0x5A5A, 0xA5A5), 4: (0x5A5A5A5A, 0xA5A5A5A5),
               8: (0x5A5A5A5A5A5A5A5A, 0xA5A5A5A5A5A5A5A5)}


def check_supported(dtype) -> None:
    if dtype not in _TYPES:
        raise TypeError(f"the MSL emulator does not support dtype {dtype} (Metal kernels take {list(_TYPES)})")


def type_string(dtype) -> str:
    check_supported(dtype)
    return _TYPES[dtype][0]


def bits_dtype(dtype):
    return _BITS[dtype.size]


def is_float(dtype) -> bool:
    return dtype in _FLOAT_POISON


def poison(dtype, run: int) -> int:
    return (_FLOAT_POISON.get(dtype) or _INT_POISON[dtype.size])[run]


def to_bits(x: mx.array) -> np.ndarray:
    """A C-contiguous numpy copy of `x`'s raw bits, in `x`'s shape."""
    check_supported(x.dtype)
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16)).reshape(x.shape)
    return np.ascontiguousarray(np.array(x)).view(bits_dtype(x.dtype)).reshape(x.shape)


def from_bits(bits: np.ndarray, dtype, shape) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(bits.reshape(shape)).view(mx.bfloat16)
    return mx.array(bits.view(_TYPES[dtype][1]).reshape(shape))


def value_bits(value: float, dtype) -> int:
    """Bits of `value` converted to `dtype` (bfloat16 rounds to nearest even), e.g. for init_value."""
    return int(to_bits(mx.array(value, dtype=dtype)))


def values(bits: np.ndarray, dtype) -> np.ndarray:
    """Numeric values of raw bits (bfloat16 widened to float32), for messages and tolerant comparisons."""
    if dtype == mx.bfloat16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(_TYPES[dtype][1])
