"""DFlash with the target split over 2 ranks: what one decoding cycle moves over the wire and how long it takes.

Runs, side by side in one invocation, on the same target, drafter and prompts (greedy, so every mode must commit
the same tokens; the script checks it):
  single            one process, whole target (the baseline)
  tensor            2 ranks, tensor parallel; the drafter runs on every rank (no draft traffic)
  tensor-bcast      2 ranks, tensor parallel; rank 0 drafts and sends the draft logits [B-1, V] (sampling needs q)
  tensor-bcast-ids  2 ranks, tensor parallel; rank 0 drafts and sends only the B-1 draft ids (greedy only)
  pipeline          2 ranks, pipeline stages (targets with mlx-lm pipeline support); tapped features of the
                    committed positions are exchanged
Per mode: ms per cycle (a cycle = one draft + one verify pass), tokens per cycle, and rank 0's bytes sent +
received per decode cycle on its ring sockets (kernel TCP counters, `dflash_mlx.distributed.comm`; a prefill-only
run's bytes are taken off), plus the
measured latency of one all-sum of a verify block's activations. Ranks are local processes on 127.0.0.1: this shows
correctness and overhead, not the speed of Thunderbolt or Ethernet between machines; both ranks share this
machine's cores.

    python benchmarks/distributed.py                          # qwen2.5-coder-0.5b + its shipped drafter
    python benchmarks/distributed.py --tiny                   # random mid-size llama and qwen3_5 (pipeline too)
    python benchmarks/distributed.py --modes single tensor --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from dflash_mlx.api import prepare
from dflash_mlx.distributed.comm import allsum_latency, collectives_per_pass
from dflash_mlx.drafters.io import load_drafter
from dflash_mlx.decode.loop import dflash_generate_step

MODES = ("single", "tensor", "tensor-bcast", "tensor-bcast-ids", "pipeline")
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
]


# -- drafting on rank 0 only (the alternative to a drafter on every rank) ------------------------------------------
class Rank0Drafter:
    """Rank 0 drafts; the others receive its draft logits (or only the draft ids) in one all-sum."""

    def __init__(self, drafter, group, ids_only: bool):
        self.drafter, self.group, self.ids_only = drafter, group, ids_only
        self.rank0 = group.rank() == 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def append_context(self, ctx, cache):
        if self.rank0:
            self.drafter.append_context(ctx, cache)

    def __call__(self, block_ids, cache):
        shape = (1, block_ids.shape[1] - 1, self.drafter.config.vocab_size)
        if self.ids_only:
            ids = mx.argmax(self.drafter(block_ids, cache), axis=-1).astype(mx.int32) if self.rank0 else \
                mx.zeros(shape[:2], dtype=mx.int32)
            ids = mx.distributed.all_sum(ids, group=self.group)
            return (ids[..., None] == mx.arange(shape[-1])).astype(mx.float32)  # one-hot: argmax = the id
        logits = self.drafter(block_ids, cache).astype(mx.float32) if self.rank0 else mx.zeros(shape)
        return mx.distributed.all_sum(logits, group=self.group)


# -- one process's measurements -----------------------------------------------------------------------------------
def _encode(tokenizer, text: str) -> List[int]:
    if tokenizer is None:
        return [(7 * i + 3) % 200 for i in range(40)]  # tiny random models: any ids will do
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _decode_run(target, drafter, ids: List[int], max_tokens: int, block: int, group, traffic) -> Dict:
    """One generation; `bytes` counts the whole run (prefill included) on this rank's ring sockets."""
    from dflash_mlx.distributed.group import barrier

    before = traffic.settled() if traffic else None
    if group is not None:
        barrier(group)  # no rank sends before every rank has read its counters
    gen = dflash_generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=max_tokens,
                               width=block)
    tic = time.perf_counter()
    first = next(gen)  # prefill
    start = time.perf_counter()
    tokens, cycles, width = list(first.tokens), 0, 0
    for cycle in gen:
        tokens += cycle.tokens
        cycles += 1
        width += cycle.width
    end = time.perf_counter()
    moved = (traffic.settled() - before).total if traffic else 0
    return dict(tokens=tokens, cycles=cycles, width=width, prefill_s=start - tic, decode_s=end - start, bytes=moved)


def _measured_run(target, drafter, ids: List[int], max_tokens: int, block: int, group, traffic) -> Dict:
    """A generation, with the bytes of its decode cycles alone (those of a prefill-only run taken off)."""
    run = _decode_run(target, drafter, ids, max_tokens, block, group, traffic)
    if traffic:
        run["bytes"] -= _decode_run(target, drafter, ids, 1, block, group, traffic)["bytes"]
    return run


def measure(mode: str, target_dir: str, drafter_dir: str, args) -> Optional[Dict]:
    """Run this process's part of `mode`; rank 0 (or the single process) returns the figures."""
    from mlx_lm.utils import load_model, load_tokenizer

    tokenizer = load_tokenizer(Path(target_dir)) if (Path(target_dir) / "tokenizer_config.json").exists() else None
    drafter = load_drafter(drafter_dir)
    group, traffic = None, None
    if mode == "single":
        model, _ = load_model(Path(target_dir))
    else:
        from dflash_mlx.distributed import FeatureExchange, load_sharded_model
        from dflash_mlx.distributed.comm import RingTraffic
        from dflash_mlx.distributed.group import init_group, share_seed

        group = init_group()
        share_seed(group)
        model = load_sharded_model(target_dir, group, pipeline=mode == "pipeline")
        traffic = RingTraffic()
    target = prepare(model, drafter)
    if mode == "pipeline":
        drafter = FeatureExchange(drafter)
    elif mode.startswith("tensor-bcast"):
        drafter = Rank0Drafter(drafter, group, ids_only=mode.endswith("ids"))
    block = args.block_size or drafter.block_size
    _decode_run(target, drafter, _encode(tokenizer, PROMPTS[0]), 4, block, group, traffic)  # warm-up
    runs = [_measured_run(target, drafter, _encode(tokenizer, p), args.max_tokens, block, group, traffic)
            for p in PROMPTS[: args.prompts]]
    latency = allsum_latency(group, block, target.hidden_size) if group is not None else None  # every rank
    if group is not None and group.rank() != 0:
        return None
    cycles = sum(r["cycles"] for r in runs)
    out = dict(mode=mode, tokens=[r["tokens"] for r in runs], cycles=cycles,
               ms_per_cycle=1e3 * sum(r["decode_s"] for r in runs) / cycles,
               tokens_per_cycle=sum(len(r["tokens"]) - 1 for r in runs) / cycles,
               verify_width=sum(r["width"] for r in runs) / cycles,
               prefill_s=sum(r["prefill_s"] for r in runs), bytes_per_cycle=sum(r["bytes"] for r in runs) / cycles,
               traffic_counted=bool(traffic and traffic.available))
    if group is not None:
        out["allsum_ms"] = 1e3 * latency
        out["collectives_per_pass"] = collectives_per_pass(model) if mode.startswith("tensor") else None
    return out


# -- the launcher -------------------------------------------------------------------------------------------------
def _tiny_models(root: Path) -> Dict[str, tuple]:
    """Random mid-size llama (tensor parallel) and qwen3_5 (tensor and pipeline) targets with random drafters."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    from dflash_mlx.drafters.config import DFlashConfig
    from dflash_mlx.drafters.io import build_drafter, save_drafter

    common = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, vocab_size=8192,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    configs = {
        "llama": dict(common, model_type="llama", rope_theta=10000.0),
        "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
            common, model_type="qwen3_5_text", linear_num_value_heads=8, linear_num_key_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
            rope_parameters={"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})),
    }
    out = {}
    for name, config in configs.items():
        mx.random.seed(0)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        target_dir, drafter_dir = root / name / "target", root / name / "drafter"
        target_dir.mkdir(parents=True)
        save_model(target_dir, model)
        save_config(config, target_dir / "config.json")
        drafter = build_drafter(DFlashConfig(
            hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=1024, vocab_size=8192, rope_theta=10000.0, num_target_layers=8, block_size=16,
            target_layer_ids=[1, 4, 6], mask_token_id=8191))
        mx.eval(drafter.parameters())
        save_drafter(drafter, drafter_dir)
        out[name] = (str(target_dir), str(drafter_dir))
    return out


def _rank_main(argv: List[str]) -> int:
    mode, target_dir, drafter_dir = argv[:3]
    args = argparse.Namespace(**json.loads(argv[3]))
    result = measure(mode, target_dir, drafter_dir, args)
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run_mode(mode: str, target_dir: str, drafter_dir: str, args) -> Dict:
    options = json.dumps(dict(block_size=args.block_size, max_tokens=args.max_tokens, prompts=args.prompts))
    if mode == "single":
        return measure(mode, target_dir, drafter_dir, args)
    from dflash_mlx.distributed.local import run_local

    results = run_local([sys.executable, os.path.abspath(__file__), "--rank", mode, target_dir, drafter_dir,
                         options], ranks=2, timeout=args.timeout)
    for r in results:
        if r.returncode != 0:
            why = "timed out" if r.timed_out else f"exit {r.returncode}"
            raise SystemExit(f"{mode}: rank {r.rank} {why}:\n{r.stderr[-3000:]}")
    line = next(x for x in results[0].stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _table(name: str, rows: List[Dict]) -> str:
    base = rows[0]
    lines = [f"\n{name}: greedy, {base['cycles']} decode cycles per mode, {base['verify_width']:.1f} tokens verified "
             "per cycle on average",
             f"{'mode':<17} {'ms/cycle':>9} {'x single':>9} {'tok/cycle':>10} {'KB/cycle':>10} {'all-sums':>9} "
             f"{'all-sum ms':>10}  same tokens"]
    for r in rows:
        kb = f"{r['bytes_per_cycle'] / 1024:.1f}" if r.get("traffic_counted") else "-"
        n = r.get("collectives_per_pass")
        lat = r.get("allsum_ms")
        lines.append(f"{r['mode']:<17} {r['ms_per_cycle']:>9.1f} {r['ms_per_cycle'] / base['ms_per_cycle']:>9.2f} "
                     f"{r['tokens_per_cycle']:>10.2f} {kb:>10} {n if n is not None else '-':>9} "
                     f"{f'{lat:.2f}' if lat is not None else '-':>10}  {r['tokens'] == base['tokens']}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return _rank_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="offline model name or local model dir")
    parser.add_argument("--draft", default=None, help="drafter dir (default: the one shipped for --model)")
    parser.add_argument("--tiny", action="store_true", help="random mid-size llama and qwen3_5 targets instead")
    parser.add_argument("--modes", nargs="+", default=None, choices=MODES)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2, choices=(1, 2))
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per 2-rank launch")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dflash-dist-bench-") as tmp:
        if args.tiny:
            pairs = _tiny_models(Path(tmp))
        else:
            from dflash_mlx.models.loading import resolve_name

            target, drafter = resolve_name(args.model, None, args.draft) if not Path(args.model).exists() \
                else (args.model, args.draft)
            pairs = {args.model: (str(target), str(drafter))}
        for name, (target_dir, drafter_dir) in pairs.items():
            # A Qwen3.5 head is split by vocabulary (the drafter shares it, so every rank drafts); only it pipelines.
            modes = args.modes or ([m for m in MODES if not m.startswith("tensor-bcast")] if name == "qwen3_5"
                                   else [m for m in MODES if m != "pipeline"])
            rows = []
            for mode in modes:
                print(f"{name}: {mode} ...", file=sys.stderr, flush=True)
                rows.append(_run_mode(mode, target_dir, drafter_dir, args))
            print(_table(name, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
