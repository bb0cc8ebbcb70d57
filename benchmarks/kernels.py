"""dflash-mlx's Metal kernels against the paths they replace, per kernel and shape, on a Mac.

For every case it times the kernel and the reference side by side in one run (median of --reps calls after
warm-up, each call evaluated and synchronized) and prints both times, the ratio, and the bandwidth each
achieves on the bytes the kernel must move (bytes_moved below: every input read once, every output written
once). Shapes are those of Qwen3.5-9B and its DFlash drafter:

  block_attention  drafter attention, 32/8 heads x 128, 16 block rows, bf16, full and sliding (window 2048)
                   layers; reference: concat + mask + mx.fast.scaled_dot_product_attention
  gdn_tape         one GatedDeltaNet layer's verify of 16 tokens (16/32 heads, 128 x 128 state);
                   reference: mlx-lm's gated_delta_update (no tape)
  gdn_replay       rolling that layer back to 8 kept tokens; reference: ReplayRollback (gated_delta_update
                   re-run on the kept prefix)
  verify_qmm       4-bit and 8-bit (group 64) linears of a 4096-wide model at 2..16 rows, bf16;
                   reference: mx.quantized_matmul

    python benchmarks/kernels.py [--kernels block_attention gdn verify_qmm] [--reps 50] [--chunks 1024 2048]
    python benchmarks/kernels.py --bytes     # no timing: bytes per call and the traffic model (any machine)

Without Metal (or with DFLASH_MLX_NO_METAL=1) only --bytes runs: the kernels are verified by emulation
(`pytest -m metal`), not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import mlx.core as mx

from dflash_mlx import metal
from dflash_mlx.metal import block_attention as ba
from dflash_mlx.metal import gdn_tape as gt
from dflash_mlx.metal import verify_qmm as vq

BF16 = 2  # bytes

# -- shapes ----------------------------------------------------------------------------------------------------
ATTN = dict(Hq=32, Hkv=8, D=128, B=16)
ATTN_CONTEXTS = [1024, 4096, 16384, 32768]
GDN = dict(Hk=16, Hv=32, Dk=128, Dv=128, T=16, keep=8)
QMM_LAYERS = [("q/o_proj", 4096, 4096), ("up/gate", 4096, 12288), ("down", 12288, 4096)]  # (name, K, N)
QMM_ROWS = [2, 4, 8, 16]


# -- bytes each call must move -----------------------------------------------------------------------------------
def attention_bytes(n_ctx: int, window=None, chunk=None) -> Tuple[int, int]:
    """(kernel, reference lower bound): the kernel reads the visible context K/V once and round-trips its float32
    partials; the reference also writes the concatenated K/V and reads it back in SDPA."""
    Hq, Hkv, D, B = ATTN["Hq"], ATTN["Hkv"], ATTN["D"], ATTN["B"]
    seen = min(n_ctx, window - 1) if window else n_ctx
    kv = 2 * Hkv * seen * D * BF16
    block = (Hq + 2 * Hkv) * B * D * BF16 + Hq * B * D * BF16  # q, block k/v in; out
    chunks = -(-(seen + B) // (chunk or ba.chunk_size(seen + B)))
    partials = 2 * chunks * Hq * B * (D + 2) * 4 if chunks > 1 else 0
    concat = 2 * Hkv * (seen + B) * D * BF16
    mask = B * (seen + B) if window else 0  # bool mask: the sliding layers here are the masked (causal) ones
    return kv + block + partials, kv + 2 * concat + block + mask


def gdn_bytes(steps: int, tape: bool, replay: bool) -> int:
    Hk, Hv, Dk, Dv = GDN["Hk"], GDN["Hv"], GDN["Dk"], GDN["Dv"]
    state = 2 * Hv * Dv * Dk * 4  # read and written, float32
    if replay:  # k, g, delta of the kept steps
        return state + steps * (Hk * Dk * BF16 + Hv * 4 + Hv * Dv * 4)
    # q, k, v, g, beta in; y out; plus the delta tape
    io = steps * (2 * Hk * Dk * BF16 + Hv * Dv * BF16 + Hv * (4 + BF16) + Hv * Dv * BF16)
    return state + io + (steps * Hv * Dv * 4 if tape else 0)


def qmm_bytes(M: int, K: int, N: int, bits: int, group_size: int = 64) -> int:
    """Weights, scales and biases once, activations in, outputs out."""
    return N * K * bits // 8 + 2 * N * (K // group_size) * BF16 + M * K * BF16 + M * N * BF16


# -- timing ------------------------------------------------------------------------------------------------------
def _median_ms(fn: Callable[[], mx.array], reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def _row(name: str, shape: str, nbytes: int, kernel_ms: float, ref_ms: float) -> None:
    gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    print(f"{name:16s} {shape:34s} {nbytes / 2**20:9.2f} {kernel_ms:9.3f} {ref_ms:9.3f} {ref_ms / kernel_ms:7.2f}x "
          f"{gbs(kernel_ms):8.1f} {gbs(ref_ms):8.1f}")


def bench_block_attention(reps: int, chunks: List[int] = ()) -> None:
    """`chunks`: pass-1 chunk sizes to try besides the default (chunk_size), one row each."""
    Hq, Hkv, D, B = ATTN["Hq"], ATTN["Hkv"], ATTN["D"], ATTN["B"]
    for n in ATTN_CONTEXTS:
        for window, causal in ((None, False), (2048, True)):
            q = mx.random.normal((1, Hq, B, D)).astype(mx.bfloat16)
            k, v = (mx.random.normal((1, Hkv, B, D)).astype(mx.bfloat16) for _ in range(2))
            # The context as a KVCache holds it: a view of a buffer allocated in steps of 256.
            cap = -(-n // 256) * 256 + 256
            ck, cv = (mx.random.normal((1, Hkv, cap, D)).astype(mx.bfloat16)[:, :, :n] for _ in range(2))
            mx.eval(q, k, v, ck, cv)
            args = (q, k, v, ck, cv)
            kw = dict(scale=D**-0.5, window=window, causal=causal)
            t_r = _median_ms(lambda: ba.block_attention_reference(*args, **kw), reps)
            for chunk in [None, *chunks]:
                t_k = _median_ms(lambda: ba.block_attention_metal(*args, **kw, chunk=chunk), reps)
                label = f"ctx {n:5d} " + (f"window {window} causal" if window else "full, bidirectional")
                label += f" chunk {chunk}" if chunk else ""
                _row("block_attention", label, attention_bytes(n, window, chunk)[0], t_k, t_r)


def _gdn_inputs():
    Hk, Hv, Dk, Dv, T = (GDN[x] for x in ("Hk", "Hv", "Dk", "Dv", "T"))
    q = (mx.random.normal((1, T, Hk, Dk)) * Dk**-0.5).astype(mx.bfloat16)
    k = mx.random.normal((1, T, Hk, Dk))
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(mx.bfloat16)
    v = mx.random.normal((1, T, Hv, Dv)).astype(mx.bfloat16)
    a, b = mx.random.normal((1, T, Hv)).astype(mx.bfloat16), mx.random.normal((1, T, Hv)).astype(mx.bfloat16)
    A_log, dt_bias = mx.random.normal((Hv,)) * 0.5, mx.random.normal((Hv,)).astype(mx.bfloat16)
    state = mx.random.normal((1, Hv, Dv, Dk)) * 0.1
    mx.eval(q, k, v, a, b, A_log, dt_bias, state)
    return q, k, v, a, b, A_log, dt_bias, state


def bench_gdn(reps: int) -> None:
    from mlx_lm.models.gated_delta import compute_g, gated_delta_update

    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs()
    T, keep = GDN["T"], GDN["keep"]
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    t_k = _median_ms(lambda: gt.gdn_tape_metal(q, k, v, g, beta, state), reps)
    t_r = _median_ms(lambda: gated_delta_update(q, k, v, a, b, A_log, dt_bias, state), reps)
    shape = f"{GDN['Hv']} x {GDN['Dv']} x {GDN['Dk']}"
    _row("gdn_tape", f"verify {T} tokens, state {shape}", gdn_bytes(T, tape=True, replay=False), t_k, t_r)

    _, _, delta = gt.gdn_tape_metal(q, k, v, g, beta, state)
    mx.eval(delta)
    t_k = _median_ms(lambda: gt.gdn_replay_metal(k, g, delta, state, keep), reps)
    pre = [x[:, :keep] for x in (q, k, v, a, b)]
    t_r = _median_ms(lambda: gated_delta_update(*pre, A_log, dt_bias, state)[1], reps)
    _row("gdn_replay", f"keep {keep} of {T}", gdn_bytes(keep, tape=False, replay=True), t_k, t_r)


def bench_verify_qmm(reps: int) -> None:
    for bits in (4, 8):
        for name, K, N in QMM_LAYERS:
            w, scales, biases = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16), group_size=64, bits=bits)
            for M in QMM_ROWS:
                x = mx.random.normal((1, M, K)).astype(mx.bfloat16)
                mx.eval(w, scales, biases, x)
                kw = dict(group_size=64, bits=bits)
                t_k = _median_ms(lambda: vq.verify_qmm_metal(x, w, scales, biases, **kw), reps)
                t_r = _median_ms(lambda: vq.verify_qmm_reference(x, w, scales, biases, **kw), reps)
                _row("verify_qmm", f"{bits}-bit {name} {K}->{N} M={M}", qmm_bytes(M, K, N, bits), t_k, t_r)


BENCHES: Dict[str, Callable[..., None]] = {
    "block_attention": bench_block_attention, "gdn": bench_gdn, "verify_qmm": bench_verify_qmm,
}


def print_bytes() -> None:
    print("bytes each call must move (MiB), and the reference's own traffic where it is larger by construction\n")
    print(f"{'kernel':16s} {'shape':34s} {'kernel':>9s} {'ref >=':>9s} {'ratio':>7s}")
    for n in ATTN_CONTEXTS:
        for window in (None, 2048):
            kern, ref = attention_bytes(n, window)
            label = f"ctx {n:5d} " + (f"window {window}" if window else "full")
            print(f"{'block_attention':16s} {label:34s} {kern / 2**20:9.2f} {ref / 2**20:9.2f} {ref / kern:6.2f}x")
    T, keep = GDN["T"], GDN["keep"]
    tape, plain = gdn_bytes(T, tape=True, replay=False), gdn_bytes(T, tape=False, replay=False)
    print(f"{'gdn_tape':16s} {f'verify {T} tokens':34s} {tape / 2**20:9.2f} {plain / 2**20:9.2f} {plain / tape:6.2f}x")
    replay, rerun = gdn_bytes(keep, tape=False, replay=True), gdn_bytes(keep, tape=False, replay=False)
    print(f"{'gdn_replay':16s} {f'keep {keep} of {T}':34s} {replay / 2**20:9.2f} {rerun / 2**20:9.2f} "
          f"{rerun / replay:6.2f}x")
    for bits in (4, 8):
        for name, K, N in QMM_LAYERS:
            for M in (2, 16):
                b = qmm_bytes(M, K, N, bits)
                print(f"{'verify_qmm':16s} {f'{bits}-bit {name} {K}->{N} M={M}':34s} {b / 2**20:9.2f}   "
                      "(reference: the weights once per pass over the rows)")


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--bytes", action="store_true", help="print bytes per call only (no Metal needed)")
    parser.add_argument("--chunks", type=int, nargs="*", default=[],
                        help="block_attention: also time these pass-1 chunk sizes (keys), to tune MIN_CHUNK")
    args = parser.parse_args(argv)
    if args.bytes:
        print_bytes()
        return
    if not metal.available():
        print("no Metal device (or DFLASH_MLX_NO_METAL is set): nothing to time. The kernels are verified by "
              "emulation (pytest -m metal); `--bytes` prints the traffic model.")
        sys.exit(0)
    print(f"{'kernel':16s} {'shape':34s} {'MiB':>9s} {'kern ms':>9s} {'ref ms':>9s} {'speedup':>8s} "
          f"{'kern GB/s':>8s} {'ref GB/s':>8s}")
    for name in args.kernels:
        if name == "block_attention":
            bench_block_attention(args.reps, args.chunks)
        else:
            BENCHES[name](args.reps)


if __name__ == "__main__":
    main()
