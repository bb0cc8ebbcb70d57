"""What exact GatedDeltaNet rollback costs, relative to the verify pass it undoes (hybrid-rollback.md, S2).

Builds random hybrid (qwen3_5-layout) targets, a tiny one and a mid-size one with real GDN head dimensions, and
times side by side, on one prefilled cache:
  verify     one target forward over a B-token block (what every DFlash cycle pays anyway)
  rollback   TargetModel.rollback after `keep` of the B tokens were committed (S2: replay the recurrence on the
             kept prefix from the pre-verify state; conv state is a slice)
  rerun      the S1 alternative: a whole target forward over the kept tokens
A full accept costs nothing (no rollback work), so it is not listed.

    python benchmarks/rollback_cost.py [--sizes tiny mid] [--blocks 4 16] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from dflash_mlx.targets import TargetModel

SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    # Qwen3.5 GDN head dims (Dk = Dv = 128), fewer heads and layers so it runs on a laptop CPU.
    "mid": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128, vocab_size=8192, linear_num_value_heads=8,
                linear_num_key_heads=4, linear_key_head_dim=128, linear_value_head_dim=128),
}


def build(size: str):
    text = dict(SIZES[size], model_type="qwen3_5_text", rms_norm_eps=1e-6, max_position_embeddings=4096,
                linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=True,
                rope_parameters={"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    config = dict(model_type="qwen3_5", text_config=text)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def timed(setup, fn, teardown, reps: int) -> float:
    """Median seconds of fn() alone (each evaluates its own results); setup/teardown run untimed around it."""
    samples = []
    for rep in range(reps + 1):
        setup()
        tic = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - tic
        teardown()
        if rep:  # the first run warms up
            samples.append(elapsed)
    return statistics.median(samples)


def measure(size: str, blocks, reps: int, context: int) -> None:
    model = build(size)
    t = TargetModel(model)
    params = sum(p.size for _, p in tree_flatten(model.parameters()))
    vocab = SIZES[size]["vocab_size"]
    ids = (mx.arange(context + max(blocks)) * 7919 + 11) % vocab
    ids = ids[None].astype(mx.int32)
    cache = t.make_cache()
    t(ids[:, :context], cache)
    mx.eval([c.state for c in cache])
    state = lambda: mx.eval([c.state for c in cache])  # noqa: E731
    nothing = lambda: None  # noqa: E731
    print(f"\n{size}: {params / 1e6:.1f}M params, {sum(l.is_linear for l in t.layers)} GDN + "
          f"{sum(not l.is_linear for l in t.layers)} attention layers, context {context}, device {mx.default_device()}")
    print(f"{'B':>3} {'keep':>4} {'verify ms':>10} {'rollback ms':>12} {'rollback/verify':>16} {'rerun/verify':>13}")
    for B in blocks:
        block = ids[:, context : context + B]

        def verify():
            logits, hidden = t(block, cache)
            mx.eval(logits, hidden, [c.state for c in cache])

        # Undoing a whole write restores the pre-verify snapshot: no compute, used as the untimed reset.
        undo = lambda: t.rollback(cache, B)  # noqa: E731
        verify_s = timed(nothing, verify, undo, reps)
        for keep in sorted({1, B // 2, B - 1} - {0}):
            def rollback():
                t.rollback(cache, B - keep)
                state()

            roll_s = timed(verify, rollback, lambda: t.rollback(cache, keep), reps)

            def rerun():
                logits, _ = t(block[:, :keep], cache)
                mx.eval(logits, [c.state for c in cache])

            rerun_s = timed(nothing, rerun, lambda: t.rollback(cache, keep), reps)
            print(f"{B:>3} {keep:>4} {verify_s * 1e3:>10.2f} {roll_s * 1e3:>12.3f} {roll_s / verify_s:>16.3f} "
                  f"{rerun_s / verify_s:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "mid"], choices=sorted(SIZES))
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    for size in args.sizes:
        measure(size, args.blocks, args.reps, args.context)


if __name__ == "__main__":
    main()
