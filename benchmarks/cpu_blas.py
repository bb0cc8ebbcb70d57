"""What each BLAS does to MLX on a Linux CPU: fp32 GEMM, one decode step and an 8-token verify.

Each measurement runs in a fresh process (the BLAS is chosen when mlx loads), cycling through MLX's bundled BLAS
(DFLASH_MLX_NO_BLAS=1), every BLAS `dflash_mlx._blas` finds on this machine (the pip wheel's, Debian's) and any
given with --blas, so machine drift hits all alike, and prints medians side by side:
  gemm      fp32 1024 x 1024 x 1024 matmul, GFLOP/s
  step      one target forward on 1 token after a 64-token prompt (a plain decode step), ms
  verify-k  one target forward on k tokens at the same point (what a DFlash verify pass costs), ms

    python benchmarks/cpu_blas.py [--model smollm2-135m] [--rounds 3] [--k 8] [--blas LABEL=LIB[:LIB...]]

The model is an offline registry model (`dflash-mlx models`), installed and converted to fp32 on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _median_time(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        tic = time.perf_counter()
        fn()
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


def child(model_name: str, k: int, reps: int) -> dict:
    import dflash_mlx  # noqa: F401  (loads the BLAS DFLASH_MLX_BLAS names, unless DFLASH_MLX_NO_BLAS is set)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from dflash_mlx import _blas
    from dflash_mlx.models.offline import ensure_offline_model

    n = 1024
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    gemm = _median_time(lambda: mx.eval(a @ b), reps)

    model, _ = load(str(ensure_offline_model(model_name, progress=False, quiet=True)))
    cache = make_prompt_cache(model)
    prompt = mx.arange(100, 164)[None]
    mx.eval(model(prompt, cache=cache))

    def forward(tokens: int):
        def run():
            mx.eval(model(mx.arange(200, 200 + tokens)[None], cache=cache))
            for c in cache:
                c.trim(tokens)
        return run

    step = _median_time(forward(1), reps)
    verify = _median_time(forward(k), reps)
    return {"blas": _blas.status, "gemm_gflops": 2 * n**3 / gemm / 1e9, "step_ms": step * 1e3,
            "verify_ms": verify * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3, help="processes per setting (alternating)")
    parser.add_argument("--k", type=int, default=8, help="tokens in the verify pass")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per process")
    parser.add_argument("--blas", action="append", default=[], metavar="LABEL=LIB[:LIB...]",
                        help="another BLAS to compare: shared libraries loaded in order (DFLASH_MLX_BLAS)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.k, args.reps)))
        return 0

    from dflash_mlx._blas import find_debian_openblas, find_pip_openblas

    settings = {"bundled": None}  # label -> DFLASH_MLX_BLAS value (None: DFLASH_MLX_NO_BLAS=1)
    if find_pip_openblas():
        settings["pip OpenBLAS"] = "pip"
    if find_debian_openblas():
        settings["Debian OpenBLAS"] = "debian"
    for spec in args.blas:
        label, _, libs = spec.partition("=")
        settings[label] = libs
    results = {label: [] for label in settings}
    for _ in range(args.rounds):
        for label, wanted in settings.items():
            env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_MLX_NO_BLAS", "DFLASH_MLX_BLAS")}
            if wanted is None:
                env["DFLASH_MLX_NO_BLAS"] = "1"
            else:
                env["DFLASH_MLX_BLAS"] = wanted
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--k", str(args.k),
                                  "--reps", str(args.reps)], env=env, capture_output=True, text=True, check=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))

    width = max(len(label) for label in results) + 2
    print(f"{args.model}, fp32, k={args.k}, medians of {args.rounds} processes per row")
    print(f"{'BLAS':<{width}}{'GEMM GFLOP/s':>14}{'step ms':>10}{f'verify-{args.k} ms':>14}{'verify/step':>13}")
    for label, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in ("gemm_gflops", "step_ms", "verify_ms")}
        print(f"{label:<{width}}{med['gemm_gflops']:>14.1f}{med['step_ms']:>10.1f}{med['verify_ms']:>14.1f}"
              f"{med['verify_ms'] / med['step_ms']:>13.2f}")
        print(f"  ({runs[0]['blas']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
