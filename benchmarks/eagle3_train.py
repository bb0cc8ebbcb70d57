"""Train a small EAGLE-3 drafter for a small target in minutes on a CPU, to measure EAGLE-3 end to end.

Not a training recipe (`dflash-mlx train` trains DFlash drafters); a short script that makes an EAGLE-3 head good
enough for `dflash-mlx bench --draft DIR` to show chains against trees on a real tokenizer and real text. To stay
within minutes on a CPU it distills from text in one target pass per sequence instead of from generated answers:

1. text: HumanEval's prompts with their canonical solutions (skipping the first `--skip` tasks, which the bench
   runs on);
2. one target pass over each text taps the default layers (the inputs of layers 2, N // 2, N - 3) and gives the
   target's own choice after every token;
3. the drafter (one layer, the target's width, a reduced head over the target's most frequent choices, `d2t`)
   learns, at every position t, the target's choice after token t+1 from (token t+1, fused taps at t), and one
   step further from its own output (EAGLE-3's training-time test, approximated: the second step attends
   causally over second-step keys only). Head and final norm start from the target's.

    python benchmarks/eagle3_train.py --model ~/.cache/dflash-mlx/models/smollm2-135m --out /tmp/eagle3-smollm2
    dflash-mlx bench --model smollm2-135m --draft /tmp/eagle3-smollm2 --tree-budget 4,8 --no-lookup
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.utils import load as mlx_lm_load

from dflash_mlx.drafters.eagle3 import Eagle3Drafter
from dflash_mlx.drafters.eagle3_config import Eagle3Config, default_taps
from dflash_mlx.drafters.io import save_drafter
from dflash_mlx.targets import build_target


def texts(skip: int, count: int):
    """HumanEval tasks `skip`..`skip + count`: each prompt with its canonical solution."""
    import gzip
    import json

    from dflash_mlx.bench.prompts import prompt_set_file

    with gzip.open(prompt_set_file("humaneval"), "rt") as f:
        records = [json.loads(line) for line in f]
    return [r["prompt"] + r["canonical_solution"] for r in records[skip : skip + count]]


def step_forward(drafter: Eagle3Drafter, embeds: mx.array, hidden: mx.array) -> mx.array:
    """The drafter's layer over a whole sequence at positions 0..L-1, causal, without a cache (for gradients)."""
    layer = drafter.layers[0]
    attn = layer.self_attn
    h = layer.hidden_norm(hidden)
    x = mx.concatenate([layer.input_layernorm(embeds), h], axis=-1)
    L = x.shape[1]
    q = attn._heads(x, attn.q_proj, attn.n_heads)
    k = attn._heads(x, attn.k_proj, attn.n_kv_heads)
    v = attn._heads(x, attn.v_proj, attn.n_kv_heads)
    q, k = attn.rope(q), attn.rope(k)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
    g = hidden + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))
    return g + layer.mlp(layer.post_attention_layernorm(g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", type=int, default=10, help="prompts left for the bench")
    ap.add_argument("--num-prompts", type=int, default=150, help="texts to distill from")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mx.random.seed(args.seed)
    model, tokenizer = mlx_lm_load(str(Path(args.model).expanduser()))
    n = len(model.layers)
    taps = default_taps(n)
    target = build_target(model, taps)
    feats, tokens, choices = [], [], []
    for text in texts(args.skip, args.num_prompts):
        ids = tokenizer.encode(text)
        logits, hidden = target(mx.array([ids], dtype=mx.int32), target.make_cache())
        choice = mx.argmax(logits[0], axis=-1)
        mx.eval(hidden, choice)
        feats.append(hidden.astype(mx.float32))
        tokens.append(ids)
        choices.append(np.array(choice))
    print(f"{len(tokens)} texts, {sum(len(t) for t in tokens)} tokens ({time.perf_counter() - t0:.0f}s)")
    V, H = target.vocab_size, target.hidden_size
    counts = np.bincount(np.concatenate(choices), minlength=V)
    kept = np.sort(np.argsort(-counts, kind="stable")[: args.draft_vocab])
    to_draft = np.full(V, -1, dtype=np.int64)
    to_draft[kept] = np.arange(kept.size)
    print(f"draft vocabulary {kept.size}: covers {counts[kept].sum() / counts.sum():.1%} of the target's choices")

    cfg = model.args
    config = Eagle3Config(hidden_size=H, num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                          vocab_size=V, head_dim=getattr(cfg, "head_dim", None), rms_norm_eps=cfg.rms_norm_eps,
                          rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                          target_layer_ids=taps, draft_vocab_size=int(kept.size), block_size=args.block_size)
    drafter = Eagle3Drafter(config)
    head = model.lm_head.weight if "lm_head" in model else model.model.embed_tokens.weight
    drafter.lm_head.weight = head[mx.array(kept)].astype(mx.float32)
    drafter.norm.weight = model.model.norm.weight.astype(mx.float32)
    drafter.d2t = mx.array(kept - np.arange(kept.size), dtype=mx.int32)
    drafter.layers[0].self_attn.o_proj.weight = drafter.layers[0].self_attn.o_proj.weight * 0.1
    drafter.layers[0].mlp.down_proj.weight = drafter.layers[0].mlp.down_proj.weight * 0.1
    drafter.freeze(keys=["d2t"])
    embed = target.embed

    def loss_fn(d, e1, x, y1, e2, y2):
        g1 = step_forward(d, e1, d.fuse(x))
        l1 = nn.losses.cross_entropy(d.draft_logits(g1), mx.maximum(y1, 0), reduction="none")
        g2 = step_forward(d, e2, g1)
        l2 = nn.losses.cross_entropy(d.draft_logits(g2), mx.maximum(y2, 0), reduction="none")
        m1, m2 = (y1 >= 0), (y2 >= 0)  # positions whose label the draft vocabulary holds
        return ((l1 * m1).sum() + 0.5 * (l2 * m2).sum()) / mx.maximum(m1.sum(), 1)

    opt = optim.AdamW(learning_rate=optim.cosine_decay(args.lr, args.steps), weight_decay=0.0)
    grad = nn.value_and_grad(drafter, loss_fn)
    rng = np.random.default_rng(args.seed)
    for step in range(args.steps):
        i = int(rng.integers(len(tokens)))
        ids, choice, f = np.array(tokens[i]), choices[i], feats[i]
        L = len(ids) - 2
        # pair t: (token t+1, taps at t) -> the target's choice after token t+1; second step: (token t+2, the
        # first step's output at t) -> its choice after token t+2
        y1 = to_draft[choice[1 : L + 1]]
        y2 = to_draft[choice[2 : L + 2]]
        e1 = embed(mx.array(ids[None, 1 : L + 1]))
        e2 = embed(mx.array(ids[None, 2 : L + 2]))
        loss, grads = grad(drafter, e1, f[:, :L], mx.array(y1[None]), e2, mx.array(y2[None]))
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    drafter.unfreeze()
    save_drafter(drafter, args.out)
    print(f"saved {args.out} ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
