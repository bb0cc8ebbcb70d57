"""What one DFlash draft costs, in one-token target steps, for each way of holding and running the drafter.

Loads the default target (fp32) and its shipped drafter twice, as stored (8-bit quantized) and as `load_drafter`
holds it on CPU (float32), prefills a prompt, then times side by side in one process, alternating variants:
  step                 one 1-token target forward (a plain decode step), the unit
  quantized, full      drafter as stored; logits scattered to the target vocabulary, then argmax (the old path)
  float32, full        dequantized at load; same scattered logits and argmax
  float32, draft-vocab argmax over the drafter's own vocabulary, ids mapped after (`greedy_draft`, the engine's
                       greedy path)
  + compiled MLPs      the same with each layer's MLP through mx.compile (the attention cannot be compiled as
                       is: its cache is no array, and its shapes change every cycle)
  tree, full vocab     float32; a DDTree of B-1 nodes from the full target-vocabulary logits (the old tree path)
  tree, own vocab      the same tree ranked over the drafter's own vocabulary (`tree_logits`, the engine's greedy
                       tree path)
Each draft also appends one committed token's features to the draft cache (and trims it), as every cycle does.

    python benchmarks/draft_cost.py [--model qwen2.5-coder-0.5b] [--blocks 4,8,16] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import dflash_mlx  # noqa: F401  (first: loads the fast BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn

from dflash_mlx import _blas
from dflash_mlx.models import offline as models
from dflash_mlx.api import load, prepare
from dflash_mlx.decode.acceptance import GreedyAcceptor
from dflash_mlx.decode.tree import propose_tree
from dflash_mlx.drafters.io import load_drafter


def _median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        tic = time.perf_counter()
        fn()
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


class _Compiled(nn.Module):
    """A module whose call runs through mx.compile (the wrapped module's weights are captured as constants)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.forward = mx.compile(module.__call__)

    def __call__(self, x: mx.array) -> mx.array:
        return self.forward(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="offline model with a shipped drafter")
    parser.add_argument("--blocks", default="4,8,16")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per block size")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]

    model, tokenizer, fast = load(args.model)  # the drafter in its fastest form, as `dflash-mlx` loads it
    stored = load_drafter(models.shipped_drafter(models.get_model(args.model)))  # as stored
    target = prepare(model, fast)
    prepare(model, stored)
    text = "def is_prime(n):\n    '''Return True when n is a prime number.'''\n" * 16
    ids = mx.array(tokenizer.encode(text)[: args.prompt_tokens], dtype=mx.int32)[None]
    cache = target.make_cache()
    logits, hidden = target(ids, cache)
    caches = {}
    for name, drafter in (("stored", stored), ("fast", fast)):
        caches[name] = drafter.make_cache()
        drafter.append_context(hidden, caches[name])
    mx.eval(logits, [c.state for c in cache], [[c.state for c in v] for v in caches.values()])
    one = hidden[:, -1:]  # the features of one committed token, appended each cycle

    def step():
        out, h = target(ids[:, -1:], cache)
        mx.eval(out, h)
        target.rollback(cache, 1)

    def drafting(drafter, dcache, draft_fn):
        def run():
            drafter.append_context(one, dcache)
            mx.eval(draft_fn(block_ids, dcache))
            for c in dcache:
                c.trim(1)
        return run

    full = lambda d: lambda b, c: mx.argmax(d(b, c)[0], axis=-1)  # noqa: E731
    plain_mlps = [layer.mlp for layer in fast.layers]
    compiled_mlps = [_Compiled(mlp) for mlp in plain_mlps]

    def with_mlps(mlps, fn):
        def run():
            for layer, mlp in zip(fast.layers, mlps):
                layer.mlp = mlp
            fn()
            for layer, mlp in zip(fast.layers, plain_mlps):
                layer.mlp = mlp
        return run
    greedy = GreedyAcceptor()

    def tree_full(b, c):
        return propose_tree(fast(b, c)[0], greedy, b.shape[1] - 1).tokens

    def tree_own(b, c):
        logits, columns = fast.tree_logits(b, c)
        return propose_tree(logits[0], greedy, b.shape[1] - 1, columns).tokens

    variants = {
        "quantized, full": drafting(stored, caches["stored"], full(stored)),
        "float32, full": drafting(fast, caches["fast"], full(fast)),
        "float32, draft-vocab": drafting(fast, caches["fast"], fast.greedy_draft),
        "+ compiled MLPs": with_mlps(compiled_mlps, drafting(fast, caches["fast"], fast.greedy_draft)),
        "tree, full vocab": drafting(fast, caches["fast"], tree_full),
        "tree, own vocab": drafting(fast, caches["fast"], tree_own),
    }
    print(f"BLAS: {_blas.status}")
    print(f"drafter as loaded: {fast.weights_form}")
    print(f"{args.model} fp32 target, {ids.shape[1]}-token context; draft time in ms and in 1-token target steps "
          f"(medians of {args.rounds} x {args.reps})")
    print(f"{'B':>3}{'step ms':>10}" + "".join(f"{v:>24}" for v in variants))
    for B in blocks:
        block_ids = mx.array([[int(ids[0, -1])] + [fast.config.mask_token_id] * (B - 1)], dtype=mx.int32)
        # Alternate step and variants so machine drift hits them alike.
        times = {name: [] for name in ["step", *variants]}
        for _ in range(args.rounds):
            times["step"].append(_median_ms(step, args.reps))
            for name, fn in variants.items():
                times[name].append(_median_ms(fn, args.reps))
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = "".join(f"{med[v]:>11.1f} ms = {med[v] / med['step']:.3f}" for v in variants)
        print(f"{B:>3}{med['step']:>10.1f}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
