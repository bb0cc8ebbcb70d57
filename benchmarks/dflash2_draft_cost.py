"""What a DFlash 2 draft costs next to a DFlash draft of the same backbone, side by side in one process.

Builds random drafters of one shape (a DFlash one and a DFlash 2 one: the same layers plus the convolutions and
the candidate selector), binds both to one random embedding and head, fills a context, and times alternately:
  dflash greedy        DFlash's `greedy_draft` (one pass, argmax per slot): the unit
  dflash2 greedy       DFlash 2's `greedy_draft` (one pass, then the selector's argmax walk over K candidates)
  dflash2 walk/greedy  the engine's greedy path: the acceptor walks the selector's full-vocabulary rows
  dflash2 walk/sample  the engine's sampling path at temperature 1 (each row through the sampling filters)
and prints milliseconds per draft and the ratio to the unit. Timings on a busy machine are noisy: compare ratios.

    python benchmarks/dflash2_draft_cost.py [--hidden 1024] [--vocab 32000] [--layers 2] [--blocks 8,16] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dflash_mlx  # noqa: F401  (first: loads the fast BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx.decode.acceptance import GreedyAcceptor, SamplingAcceptor
from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_mlx.drafters.dflash import DFlashDrafter, TargetBinding
from dflash_mlx.decode.sampling import SamplingParams


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    rng = np.random.default_rng(seed)
    new = [(k, mx.array((rng.standard_normal(v.shape) / np.sqrt(v.shape[-1])).astype(np.float32)))
           for k, v in tree_flatten(module.parameters())]
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())
    return module


def _time(fn, reps: int) -> float:
    mx.eval(fn())  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    H, V = args.hidden, args.vocab
    shape = dict(hidden_size=H, num_hidden_layers=args.layers, num_attention_heads=H // 128, num_key_value_heads=2,
                 head_dim=128, intermediate_size=3 * H, vocab_size=V, num_target_layers=8,
                 target_layer_ids=[1, 3, 5], mask_token_id=V - 1)
    embed = mx.random.normal((V, H), key=mx.random.key(0)) * 0.02
    head = mx.random.normal((V, H), key=mx.random.key(1)) / np.sqrt(H)
    binding = TargetBinding(lambda ids: embed[ids], lambda h: h @ head.T)
    context = mx.random.normal((1, args.context, 3 * H), key=mx.random.key(2))
    print(f"hidden {H}, vocab {V}, {args.layers} layers, context {args.context}; ms per draft (median of "
          f"{args.reps}), ratio to DFlash greedy")
    for B in (int(b) for b in args.blocks.split(",")):
        d1 = _randomize(DFlashDrafter(DFlashConfig(block_size=B, **shape)), 1).bind(binding)
        d2 = _randomize(DFlash2Drafter(DFlash2Config(block_size=B, conv_kernel_size=2, conv_group_size=16,
                                                     selector_rank=256, selector_top_k=16, **shape)), 1)
        d2.bind(binding)
        caches = {}
        for name, d in (("d1", d1), ("d2", d2)):
            caches[name] = d.make_cache()
            d.append_context(context, caches[name])
        block = mx.array([[5] + [V - 1] * (B - 1)])
        greedy, sampler = GreedyAcceptor(), SamplingAcceptor(SamplingParams(temp=1.0), (), seed=0)
        variants = {
            "dflash greedy": lambda: d1.greedy_draft(block, caches["d1"]),
            "dflash2 greedy": lambda: d2.greedy_draft(block, caches["d2"]),
            "dflash2 walk/greedy": lambda: greedy.propose_walk(d2.draft_walk(block, caches["d2"]), 5),
            "dflash2 walk/sample": lambda: sampler.propose_walk(d2.draft_walk(block, caches["d2"]), 5),
        }
        results = {name: [] for name in variants}
        for _ in range(3):  # alternate, so drift on a busy machine hits every variant alike
            for name, fn in variants.items():
                results[name].append(_time(fn, args.reps))
        unit = statistics.median(results["dflash greedy"])
        for name, ms in results.items():
            m = statistics.median(ms)
            print(f"  block {B:>2}  {name:<20} {m:8.2f} ms   {m / unit:5.2f}x")


if __name__ == "__main__":
    main()
