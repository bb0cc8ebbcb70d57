"""Where one training micro-batch's time goes: each piece of the drafter's training step timed alone (forward and
backward, compiled, CPU seconds and wall) on a real batch from a feature cache, with its FLOPs per predicted slot,
next to the whole compiled step. Prints a markdown table (docs/training.md, "Where the time goes").

    python benchmarks/train_profile.py --target PATH --data DIR --cache DIR -- --num-layers 3 --draft-vocab 8192 \\
        --seq-len 512 --anchors 128

Options after `--` are `TrainArgs` fields. `--builtin-math` times MLX's own exp/softmax/SiLU instead of
train/fastmath.py's, to see what those save.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from train_throughput import _spec, split_argv  # the same "-- trainer flags" convention (run from benchmarks/)


def main() -> None:
    argv, extra = split_argv(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per piece (the fastest counts)")
    p.add_argument("--builtin-math", action="store_true")
    a = p.parse_args(argv)
    spec = _spec(extra)

    import dflash_mlx  # noqa: F401  (first: it picks the BLAS before mlx loads)
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_mlx.train import fastmath
    from dflash_mlx.train.args import TrainArgs
    from dflash_mlx.train.forward import _block_attention, _context_kv, _mlp
    from dflash_mlx.train.loss import block_loss
    from dflash_mlx.train.masks import context_mask, slot_mask
    from dflash_mlx.train.session import setup_run

    if a.builtin_math:
        fastmath._builtin = lambda: True
    args = TrainArgs(out=tempfile.mkdtemp(), progress=False, target=a.target, data=[a.data], cache=a.cache, **spec)
    args.batch_blocks = args.rows * args.anchors  # one micro-batch per step: the optimizer is timed on its own
    _, _, _, drafter, trainer, _, _ = setup_run(args, False, lambda *x: None)
    c = drafter.config
    batch = trainer.batch(0, 0)
    mx.eval(batch)
    R, S = batch["tokens"].shape
    A, B, H, L = args.anchors, c.block_size, c.hidden_size, c.num_hidden_layers
    hd = c.head_dim or H // c.num_attention_heads
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    vocab = c.draft_vocab_size or c.vocab_size
    slots = int((batch["labels"] >= 0).sum().item())
    tokens = R * A * B  # block tokens through the layers

    rows = []

    def timed(name, fn, flops, *xs, layers=1, compile=True):
        fn = mx.compile(fn) if compile else fn  # the trainer's own step functions are compiled already
        mx.eval(fn(*xs))
        best = None
        for _ in range(a.repeat):
            cpu, wall = time.process_time(), time.perf_counter()
            mx.eval(fn(*xs))
            t = (time.process_time() - cpu, time.perf_counter() - wall)
            best = t if best is None or t[0] < best[0] else best
        rows.append((name, layers * flops / slots, layers * best[0], layers * best[1]))

    def grads_of(module, f):
        def run(*xs):
            def loss(params, *inputs):
                module.update(params)
                return f(*inputs).sum()
            return mx.grad(loss, argnums=tuple(range(len(xs) + 1)))(module.trainable_parameters(), *xs)
        return run

    feats = batch["features"].astype(mx.float32)
    timed("fusion fc + norm (features -> context)", grads_of(drafter.fc, lambda f: drafter.hidden_norm(drafter.fc(f))),
          2 * 2 * R * S * c.num_taps * H * H, feats)
    ctx = drafter.hidden_norm(drafter.fc(feats))
    layer = drafter.layers[0]
    attn = layer.self_attn
    timed("context K/V (per row, all anchors)", grads_of(attn, lambda x: mx.concatenate(
        [t.reshape(-1) for t in _context_kv(attn, x)])), 3 * 2 * R * S * H * 2 * kv_dim, ctx, layers=L)
    ck, cv = _context_kv(attn, ctx)
    x = mx.random.normal((R, A * B, H), key=mx.random.key(0))
    mask = context_mask(batch["anchors"], S, B, attn.sliding_window)
    slot = slot_mask(B, causal=True) if attn.block_causal else None
    mx.eval(ck, cv, x, mask)
    timed("block attention: q/k/v/o projections + scores", grads_of(
        attn, lambda x, k, v: _block_attention(attn, x, k, v, batch["anchors"], mask, slot, batch["bands"])),
        3 * 2 * (tokens * H * (2 * q_dim + 2 * kv_dim) + tokens * c.num_attention_heads * hd * (S + B) * 2),
        x, ck, cv, layers=L)
    timed("MLP (SwiGLU)", grads_of(layer.mlp, lambda x: _mlp(layer.mlp, x)), 3 * 2 * tokens * 3 * H * c.intermediate_size,
          x, layers=L)
    norms = nn.Module()
    norms.pre, norms.post = layer.input_layernorm, layer.post_attention_layernorm
    timed("RMSNorms + residuals", grads_of(norms, lambda x: norms.post(norms.pre(x) + x) + x), 0, x, layers=L)
    h = mx.random.normal((R, A, B - 1, H), key=mx.random.key(1))
    mx.eval(h)
    loss_of = lambda h: block_loss(drafter.draft_logits(h), batch["labels"], trainer.weights)[0]  # noqa: E731
    timed("LM head + loss (input gradient only)", mx.grad(loss_of), 2 * 2 * R * A * (B - 1) * H * vocab, h)

    total = trainer.flops_per_micro
    weight = mx.array(float(slots))
    timed("whole compiled micro-batch (forward + backward)", lambda: trainer._micro(batch, weight)[2], total,
          compile=False)
    grads = trainer._micro(batch, weight)[2]
    mx.eval(grads)
    n_params = sum(v.size for _, v in tree_flatten(drafter.trainable_parameters()))
    timed("optimizer (clip + AdamW, once per step)", lambda: trainer._apply(grads, weight), 0, compile=False)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(a.repeat):
        mx.eval(trainer.batch(1, i))
    rows.append(("host: build one micro-batch (overlapped)", 0.0, (time.process_time() - cpu) / a.repeat,
                 (time.perf_counter() - wall) / a.repeat))

    whole = next(r for r in rows if r[0].startswith("whole"))
    print(f"{R} row(s) x {A} anchors x {S} tokens, block {B}, {L} layers, hidden {H}, MLP {c.intermediate_size}, "
          f"vocab {vocab}: {slots} predicted slots per micro-batch; {n_params / 1e6:.1f} M trained parameters; "
          f"{'MLX exp/softmax/SiLU' if a.builtin_math else 'fastmath exp/softmax/SiLU'}")
    print("\n| piece (forward + backward) | MFLOP/slot | ms CPU | ms wall | µs CPU/slot | GFLOP/CPU-s | share |")
    print("|---|---|---|---|---|---|---|")
    for name, fps, cpu, wall in rows:
        rate = f"{fps * slots / cpu / 1e9:.0f}" if fps and cpu else "-"
        print(f"| {name} | {fps / 1e6:.2f} | {cpu * 1e3:.0f} | {wall * 1e3:.0f} | {cpu / slots * 1e6:.0f} | {rate} | "
              f"{cpu / whole[2]:.0%} |")
    print(f"\nwhole micro-batch: {slots / whole[2]:.0f} slots per CPU-second, {slots / whole[3]:.0f} per second")


if __name__ == "__main__":
    main()
