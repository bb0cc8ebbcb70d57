"""What one target verify pass costs by its number of rows, as a chain and as a draft tree, in decode steps.

Loads a target (default: the default pair's, fp32), prefills a prompt, then times in one process, alternating:
  step             one 1-token target forward (a plain decode step), the unit
  chain k          a k-token chain verify (then rolled back), k = 2..17
  tree n           `tree_forward` over a tree of n nodes (n + 1 rows): a star (every node a child of the root)
                   and a chain-shaped one (each node the child of the previous); nothing is written to the caches
Rows are what the verify matmuls see; their speed depends on the row count as the BLAS (or the GPU kernel) tiles
it, which is why `tree_budget="auto"` offers trees of 3, 7 and 15 nodes (4, 8 and 16 rows).

    python benchmarks/tree_cost.py [--model qwen2.5-coder-0.5b] [--context 300] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dflash_mlx  # noqa: F401  (first: loads the fast BLAS before mlx)
import mlx.core as mx
from mlx_lm import load

from dflash_mlx.models.loading import resolve_target
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.tree import tree_forward


def _median_s(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        tic = time.perf_counter()
        fn()
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="target: offline name, folder or repo id")
    parser.add_argument("--context", type=int, default=300, help="tokens in the cache before the passes")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per measurement")
    parser.add_argument("--rows", default="2,3,4,5,6,7,8,9,12,16,17", help="row counts to time")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]

    model, _ = load(resolve_target(args.model))
    target = TargetModel(model, [1])
    cache = target.make_cache()
    ids = mx.array([[100 + i % 5000 for i in range(args.context)]], dtype=mx.int32)
    logits, hidden = target(ids, cache)
    mx.eval(logits, hidden)

    def chain(k: int):
        def run():
            out = target(mx.full((1, k), 7, dtype=mx.int32), cache)
            mx.eval(out)
            target.rollback(cache, k)
        return run

    def tree(parents):
        def run():
            out, hid, _ = tree_forward(target, mx.full((1, len(parents)), 7, dtype=mx.int32), parents, cache)
            mx.eval(out, hid)
        return run

    step = _median_s(chain(1), args.reps)
    print(f"{args.model}, {args.context} cached tokens: one decode step {step * 1e3:.1f} ms")
    print("rows  chain  tree (star)  tree (chain-shaped)   [decode steps]")
    for r in rows:
        star, line = [-1] + [0] * (r - 1), [-1] + list(range(r - 1))
        print(f"{r:4d}  {_median_s(chain(r), args.reps) / step:5.2f}  {_median_s(tree(star), args.reps) / step:11.2f}"
              f"  {_median_s(tree(line), args.reps) / step:19.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
