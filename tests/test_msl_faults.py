"""The MSL emulator's own checks: the signature MLX writes, and the faults it must flag.

Each fault test runs a deliberately broken kernel directly on the emulator (on a GPU it would hang or silently
misbehave) and checks the report; the lint and compile-error tests check what is refused before any run.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from msl import emulator
from msl.emulator import CompileError, Fault, LintError

pytestmark = pytest.mark.skipif(not emulator.supported(), reason="the MSL emulator needs Linux and g++")


def emulated(name, inputs, outputs, source, header="", **kw):
    return emulator.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=source, header=header,
                                 **kw)


SIGNATURE = """
    uint i = thread_position_in_grid.x;
    out[i] = T(a[i % a_shape[a_ndim - 1]] * s + float(small[0]) + float(simdgroup_index_in_threadgroup));
"""


def test_signature_is_the_one_mlx_writes(capsys):
    k = emulated("sig", ["a", "s", "small"], ["out"], SIGNATURE)
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    (out,) = k(inputs=[a, 0.5, mx.array([7, 0, 0], dtype=mx.int32)], template=[("T", mx.float16)],
               grid=(40, 1, 1), threadgroup=(40, 1, 1), output_shapes=[(40,)], output_dtypes=[mx.float16],
               verbose=True)
    # As mlx/backend/common/metal_kernel.cpp writes it: `_shape`/`_ndim` only because the body names them, the
    # 0-d input by reference, the 3-element one in constant space, attributes in MLX's table order.
    name = "custom_kernel_sig__float16_t_float_floats_int32_tc_float16_t"
    assert f"""template <typename T>
[[kernel]] void {name}(
  const device float* a [[buffer(0)]],
  const constant int* a_shape [[buffer(1)]],
  const constant int& a_ndim [[buffer(2)]],
  const constant float& s [[buffer(3)]],
  const constant int32_t* small [[buffer(4)]],
  device float16_t* out [[buffer(5)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {{
{SIGNATURE}
}}

template [[host_name("{name}")]] [[kernel]] decltype({name}<float16_t>) {name}<float16_t>;
""" in capsys.readouterr().out
    want = np.arange(40) % 4 * 0.5 + 7 + (np.arange(40) >= 32)
    np.testing.assert_array_equal(np.array(out), want.astype(np.float16))


# ---- faults: each a deliberately broken kernel the harness must flag ----

@pytest.mark.parametrize("between", ["", "s = simd_sum(s);"], ids=["nothing", "a collective"])
def test_missing_barrier_is_caught_by_running_both_thread_orders(between):
    # A SIMD collective between the write and the read is no barrier: other SIMD groups may not have written yet.
    source = """
    threadgroup float buf[64];
    uint t = thread_index_in_threadgroup;
    float s = x[thread_position_in_grid.x];
    buf[t] = s;
    {BETWEEN}
    {BARRIER}
    out[thread_position_in_grid.x] = buf[63 - t] + 0.0f * s;
    """.replace("{BETWEEN}", between)
    x = mx.arange(128, dtype=mx.float32)
    call = dict(inputs=[x], grid=(128, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(128,)],
                output_dtypes=[mx.float32])
    with pytest.raises(Fault, match="depends on thread order"):
        emulated("no_barrier", ["x"], ["out"], source.replace("{BARRIER}", ""))(**call)
    fixed = emulated("barrier", ["x"], ["out"],
                     source.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);"))
    (out,) = fixed(**call)
    want = np.arange(128).reshape(2, 64)[:, ::-1].reshape(-1)
    np.testing.assert_array_equal(np.array(out), want)


def test_sharing_inside_a_simd_group_needs_a_simdgroup_barrier():
    # Lanes are not assumed to run in lockstep: a lane reading another lane's write needs a barrier between.
    source = """
    threadgroup float buf[32];
    uint t = thread_index_in_threadgroup;
    buf[t] = x[t];
    {BARRIER}
    out[t] = buf[31 - t];
    """
    call = dict(inputs=[mx.arange(32, dtype=mx.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(32,)], output_dtypes=[mx.float32])
    with pytest.raises(Fault, match="depends on thread order"):
        emulated("lockstep", ["x"], ["out"], source.replace("{BARRIER}", ""))(**call)
    (out,) = emulated("simd_barrier", ["x"], ["out"],
                      source.replace("{BARRIER}", "simdgroup_barrier(mem_flags::mem_threadgroup);"))(**call)
    np.testing.assert_array_equal(np.array(out), np.arange(32)[::-1])


def test_simd_collective_under_divergent_control_flow():
    k = emulated("divergent_sum", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    float v = x[i];
    if (thread_index_in_simdgroup < 16) {
        v = simd_sum(v);
    }
    out[i] = v;
    """)
    waits = r"threads 0-15 wait at simd_sum \(divergent_sum\.source:5\); threads 16-31 returned"
    with pytest.raises(Fault, match="divergent control flow.*" + waits):
        k(inputs=[mx.ones((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
          output_dtypes=[mx.float32])


@pytest.mark.parametrize("escape, others", [
    ("return;", "threads 40-63 returned"),
    ("threadgroup_barrier(mem_flags::mem_none);",
     r"threads 40-63 wait at threadgroup_barrier \(half_barrier\.source:5\)"),
])
def test_barrier_not_reached_by_every_thread_is_a_deadlock_not_a_hang(escape, others):
    k = emulated("half_barrier", ["x"], ["out"], f"""
    uint t = thread_index_in_threadgroup;
    out[t] = x[t];
    if (t >= 40) {{
        {escape}
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    """)
    with pytest.raises(Fault, match=r"deadlock.*threads 0-39 wait at threadgroup_barrier \(half_barrier\.source:7\); "
                                    + others):
        k(inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
          output_dtypes=[mx.float32])


def test_endless_loop_is_stopped_by_the_watchdog(monkeypatch):
    monkeypatch.setenv(emulator.TIMEOUT_ENV, "0.5")
    k = emulated("spin", ["x"], ["out"], """
    volatile uint spins = 0;
    while (x[0] > 0.0f) {  // never ends: x[0] is 1
        spins = spins + 1;
    }
    out[thread_position_in_grid.x] = float(spins);
    """)
    with pytest.raises(Fault, match="ran for more than 500 ms, stopped in thread \\(0,0,0\\)"):
        k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])


def test_output_element_never_written():
    k = emulated("even_only", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    if (i % 2 == 0) {
        out[i] = x[i];
    }
    """)
    call = dict(inputs=[mx.ones((16,), dtype=mx.int32)], grid=(16, 1, 1), threadgroup=(16, 1, 1),
                output_shapes=[(16,)], output_dtypes=[mx.int32])
    with pytest.raises(Fault, match=r"8 of 16 elements never written.*first at index \(1,\)"):
        k(**call)
    (out,) = k(**call, init_value=-1)  # leaving elements alone is fine when they start from init_value
    assert np.array(out).tolist() == [1, -1] * 8


def test_private_variables_read_before_they_are_set():
    call = dict(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                output_dtypes=[mx.float32])
    seen_by_gcc = emulated("uninit", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    float acc;
    for (int k = 0; k < 4; ++k) { acc += x[i]; }
    out[i] = acc;
    """)
    with pytest.raises(CompileError, match=r"uninit\.source:4.*'acc' is used uninitialized"):
        seen_by_gcc(**call)
    # What g++ cannot see reads the poison fresh stacks hold (NaN), as it would read garbage on a GPU.
    (out,) = emulated("uninit_array", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    volatile float v[4];
    if (i == 0) { v[1] = x[i]; }
    out[i] = v[1];
    """)(**call)
    assert np.isnan(np.array(out)[1:]).all() and np.array(out)[0] == 1


def test_out_of_range_accesses_hit_guard_pages():
    read_past = emulated("read_past", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    out[i] = x[i + 1];
    """)
    with pytest.raises(Fault, match=r"out-of-range read at byte 256 of 'x' \(256 bytes long\).*thread \(63,0,0\)"):
        read_past(inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                  output_dtypes=[mx.float32])
    write_input = emulated("write_input", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    const_cast<device float*>(x)[i] = 0.0f;
    out[i] = 1.0f;
    """)
    with pytest.raises(Fault, match="write to input 'x', which is read-only"):
        write_input(inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                    output_dtypes=[mx.float32])
    tg_overrun = emulated("tg_overrun", ["x"], ["out"], """
    threadgroup float buf[64];
    uint t = thread_index_in_threadgroup;
    buf[t + 1] = x[t];
    out[t] = 1.0f;
    """)
    with pytest.raises(Fault, match="out-of-range write of a threadgroup array"):
        tg_overrun(inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                   output_dtypes=[mx.float32])


def test_stack_overflow_is_reported():
    k = emulated("huge_private_array", ["x"], ["out"], """
    uint i = thread_position_in_grid.x;
    volatile float big[100000];  // 400 KB of thread-private memory: far beyond a fiber's stack (and a GPU's)
    big[i * 999] = x[i];
    out[i] = big[i * 999];
    """)
    with pytest.raises(Fault, match="stack overflow"):
        k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])


def test_threadgroup_memory_limit_and_thread_limit():
    k = emulated("too_much_tg", ["x"], ["out"], """
    threadgroup float a[6000];
    threadgroup float b[3000];
    uint t = thread_index_in_threadgroup;
    a[t] = x[t];
    b[t] = x[t];
    out[t] = a[t] + b[t];
    """)
    call = dict(inputs=[mx.ones((32,))], grid=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.float32])
    with pytest.raises(Fault, match="36000 bytes exceeds Metal's limit of 32768"):
        k(threadgroup=(32, 1, 1), **call)
    with pytest.raises(Fault, match="Metal allows 1 to 1024"):
        k(threadgroup=(32, 33, 1), **{**call, "grid": (32, 33, 1)})


@pytest.mark.parametrize("bad, why", [
    ("std::max(x[0], 0.0f)", r"`std::`"),
    ("double(x[0])", r"`double`"),
    ("*(new float(x[0]))", r"`new`"),
    ("x[0]; printf(\"%f\", x[0])", r"C library"),
    ("x[0]; try { out[1] = 1.0f; } catch (...) {}", r"exceptions"),
])
def test_lint_rejects_what_metal_forbids(bad, why):
    with pytest.raises(LintError, match=why):
        emulated("bad", ["x"], ["out"], f"out[0] = {bad};")


def test_lint_rejects_threadgroup_declarations_it_cannot_share():
    with pytest.raises(LintError, match="one threadgroup variable per statement"):
        emulated("two_arrays", ["x"], ["out"], "threadgroup float a[4], b[4];\nout[0] = x[0];")


def test_lint_rejects_recursion():
    header = "inline uint fact(uint n) { return n < 2 ? 1 : n * fact(n - 1); }\n"
    with pytest.raises(LintError, match="`fact` -> `fact`"):
        emulated("recursive", ["x"], ["out"], "out[0] = fact(x[0]);", header=header)
    header = ("inline bool is_odd(uint n);\n"
              "inline bool is_even(uint n) { return n == 0 ? true : is_odd(n - 1); }\n"
              "inline bool is_odd(uint n) { return n == 0 ? false : is_even(n - 1); }\n"
              "inline uint twice(uint n) { return metal::max(n, n) * 2; }\n")
    with pytest.raises(LintError, match="`is_even` -> `is_odd` -> `is_even`"):
        emulated("mutual", ["x"], ["out"], "out[0] = is_even(x[0]);", header=header)
    emulated("helpers", ["x"], ["out"], "out[0] = twice(x[0]);", header=header.split("\n", 3)[3])  # no cycle


def test_compile_errors_point_at_the_body_line():
    k = emulated("typo", ["x"], ["out"], "uint i = thread_position_in_grid.x;\nout[i] = x[i] + undefined_name;\n")
    with pytest.raises(CompileError, match=r"typo\.source:2"):
        k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])
