"""What a verified row costs at a long context, and where it goes: one target pass by its row count over an empty
cache and over a long one (a chain, and a draft tree of as many nodes), then one layer's attention pieces at that
length.

    python benchmarks/row_cost.py [--model qwen2.5-coder-0.5b] [--context 8800] [--rows 1,4,8,16,32] [--mlx-attention]

The long cache is filled with random keys and values (no prefill: a pass's cost depends on the cache's length,
not on what it holds), so the figures come in a minute. Prints, per row count, the seconds of a pass (best of
`--reps`) with an empty cache and with `--context` cached tokens, the same rows verified as a draft tree (a binary
tree: node i the child of node (i-1)//2) over the long cache, and the seconds each further row adds. Then, for
the widest row count, one attention layer's parts as MLX runs them on this device: the scores (q k^T), the softmax
(and its `exp` alone, against NumPy's `exp` on the same numbers), and the weighted sum of values. The passes run
the engine's attention, which on MLX's CPU backend computes the softmax's exponent as a fused polynomial
(`dflash_mlx.targets.attention`; float32 passes attend on the host through NumPy); `--mlx-attention` times them
with MLX's own attention instead, `--no-host-attention` with the fused exponent for float32 too.
"""

from __future__ import annotations

import argparse
import time

import dflash_mlx  # noqa: F401  (first: loads the fast BLAS before mlx)
import mlx.core as mx
import numpy as np


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def filled_caches(target, context: int):
    caches = target.make_cache()
    if context:
        for cache, layer in zip(caches, target.layers):
            attn = layer.self_attn
            shape = (1, attn.n_kv_heads, context, attn.head_dim if hasattr(attn, "head_dim") else
                     attn.k_proj.weight.shape[0] // attn.n_kv_heads)
            cache.update_and_fetch(mx.random.normal(shape) * 0.1, mx.random.normal(shape) * 0.1)
        mx.eval([c.state for c in caches])
    return caches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=8800, help="cached tokens of the long context")
    parser.add_argument("--rows", default="1,4,8,16,32", help="row counts to time")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mlx-attention", action="store_true",
                        help="time the passes with MLX's own attention, not the engine's CPU path")
    parser.add_argument("--no-host-attention", action="store_true",
                        help="the engine's CPU path without its NumPy attention (float32 through the fused exponent)")
    args = parser.parse_args(argv)
    from dflash_mlx.targets import attention

    attention.ENABLED = not args.mlx_attention
    attention.HOST = not args.no_host_attention
    rows = [int(r) for r in args.rows.split(",")]

    from dflash_mlx import load
    from dflash_mlx.models.loading import prepare
    from dflash_mlx.targets.tree import tree_segment
    from dflash_mlx.targets.walk import run

    model, _, drafter = load(args.model)
    target = prepare(model, drafter)
    print(f"{args.model}: one target pass by rows (best of {args.reps}), "
          f"{'MLX' if args.mlx_attention else 'the engine'}'s attention"
          f"{' without the host path' if args.no_host_attention and not args.mlx_attention else ''}")
    print(f"{'rows':>5} {'empty cache (s)':>16} {f'{args.context} cached (s)':>18} {'as a tree (s)':>18}")
    timed = {}
    for n in rows:
        ids = mx.array([[100 + i for i in range(n)]])
        cost = []
        for context in (0, args.context):
            def one_pass():
                caches = filled_caches(target, context)
                tic = time.perf_counter()
                logits, _ = target(ids, caches)
                mx.eval(logits)
                return time.perf_counter() - tic
            cost.append(min(one_pass() for _ in range(args.reps)))
        timed[n] = cost
        tree = "-"
        if n > 1:
            def tree_pass():
                caches = filled_caches(target, args.context)
                segment = tree_segment(target, ids, [-1] + [(i - 1) // 2 for i in range(1, n)], caches)
                tic = time.perf_counter()
                (logits,), _ = run(target, [segment])
                mx.eval(logits)
                return time.perf_counter() - tic
            tree = f"{min(tree_pass() for _ in range(args.reps)):.3f}"
        print(f"{n:>5} {cost[0]:>16.3f} {cost[1]:>18.3f} {tree:>18}")
    lo, hi = min(rows), max(rows)
    if hi > lo:
        for i, label in ((0, "empty cache"), (1, f"{args.context} cached")):
            print(f"each further row, {label}: {(timed[hi][i] - timed[lo][i]) / (hi - lo):.4f} s")

    attn = target.layers[0].self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    dim = attn.q_proj.weight.shape[0] // heads
    q = mx.random.normal((1, kv_heads, (heads // kv_heads) * hi, dim))
    k = mx.random.normal((1, kv_heads, args.context + hi, dim))
    v = mx.random.normal((1, kv_heads, args.context + hi, dim))
    scores = q @ k.swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(q, k, v, scores, probs)
    on_host = np.array(scores)
    parts = {
        "scores q k^T": lambda: mx.eval(q @ k.swapaxes(-1, -2)),
        "softmax": lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)),
        "  its exp alone": lambda: mx.eval(mx.exp(scores)),
        "  NumPy's exp, same numbers": lambda: np.exp(on_host),
        "weighted values p v": lambda: mx.eval(probs @ v),
    }
    print(f"one attention layer, {hi} rows x {heads} heads against {args.context + hi} keys "
          f"({scores.size / 1e6:.1f}M scores), on {mx.default_device()}:")
    for name, fn in parts.items():
        fn()
        print(f"  {name:<28} {1000 * best_of(fn, 2 * args.reps + 1):8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
