"""The model card a training run writes next to its drafter: what it is for, the recipe it was trained with (every
hyperparameter), its data and cost, held-out τ against slots seen and training FLOPs (a table, and a PNG when
matplotlib is installed: `pip install "dflash-mlx[bench]"`) with the compute the curve predicts for τ 3.5, and the
drafter's figures on the bench once measured:

    dflash-mlx bench ... --out RESULTS        # the drafter with its target: plain, B=16 and adaptive
    python -m dflash_mlx.train.card DRAFTER_DIR RESULTS/bench.json
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import DFlashError

CURVE_PNG = "tau_curve.png"
BENCH_JSON = "bench_figures.json"  # the figures the card shows, next to it
BENCH_HEADING = "## On the bench"
GOAL_TAU = 3.5


@dataclass(frozen=True)
class BenchFigures:
    """The drafter on the bench (one `dflash-mlx bench` report): τ at its block size with every cycle verifying the
    whole block, and τ and speed with the adaptive width, against plain greedy decoding in the same run."""

    block_size: int
    tau_fixed: float
    tau_adaptive: float
    speedup_adaptive: float  # DFlash (adaptive width) tok/s over plain greedy tok/s
    plain_tok_s: float
    adaptive_tok_s: float
    prompts: int
    identical: str  # prompts whose output equals plain decoding, "k/n"
    source: str = ""

    @classmethod
    def from_report(cls, report: Dict, source: str = "") -> "BenchFigures":
        """Pick plain (mlx-lm), DFlash at a fixed block and DFlash adaptive out of a bench report's methods."""
        methods = report.get("methods") or []
        plain = next((m for m in methods if m.get("kind") == "mlx-lm"), None)
        dflash = [m for m in methods if m.get("kind") == "dflash"]
        adaptive = next((m for m in dflash if m["name"].endswith("adaptive")), None)
        fixed = next((m for m in dflash if not m["name"].endswith("adaptive")), None)
        if plain is None or adaptive is None or fixed is None:
            raise DFlashError(f"bench report {source or ''} lacks plain, 'dflash B=N' or 'dflash adaptive' results: "
                              "run `dflash-mlx bench` without --no-fixed-draft (its default runs all three)")
        return cls(block_size=int(fixed["block"]), tau_fixed=float(fixed["tau"]), tau_adaptive=float(adaptive["tau"]),
                   speedup_adaptive=float(adaptive["speedup"]), plain_tok_s=float(plain["tok_s"]),
                   adaptive_tok_s=float(adaptive["tok_s"]), prompts=int(adaptive["prompts"]),
                   identical=f"{adaptive['identical']}/{adaptive['prompts']}", source=str(source))

    @classmethod
    def from_dict(cls, raw: Dict) -> "BenchFigures":
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def bench_section(fig: BenchFigures) -> str:
    return f"""{BENCH_HEADING}

| | |
|---|---|
| τ at B={fig.block_size} (every cycle verifies the block) | {fig.tau_fixed:.2f} |
| τ with the adaptive width | {fig.tau_adaptive:.2f} |
| speedup with the adaptive width | {fig.speedup_adaptive:.2f}x plain greedy ({fig.adaptive_tok_s:.2f} vs {fig.plain_tok_s:.2f} tok/s) |
| prompts | {fig.prompts}, output identical to plain decoding on {fig.identical} |

Measured by `dflash-mlx bench`{f' ({fig.source})' if fig.source else ''}.
"""


def projection(history: List[Dict], goal: float = GOAL_TAU) -> Optional[Dict]:
    """What the held-out curve predicts for τ = `goal`: a least-squares line τ = a + b·log10(FLOPs) through the
    evaluations after training started, extended to `goal`. None without two such points or a rising line."""
    pts = [(math.log10(h["flops"]), h["tau"], h.get("slots") or 0) for h in history if (h.get("flops") or 0) > 0]
    if len(pts) < 2 or len({x for x, _, _ in pts}) < 2:
        return None
    n = len(pts)
    mx_, my = sum(x for x, _, _ in pts) / n, sum(y for _, y, _ in pts) / n
    b = sum((x - mx_) * (y - my) for x, y, _ in pts) / sum((x - mx_) ** 2 for x, _, _ in pts)
    if b <= 0:
        return None
    a = my - b * mx_
    last_x, last_tau, last_slots = pts[-1]
    flops = 10 ** ((goal - a) / b)
    slots = flops * last_slots / 10 ** last_x  # slots per FLOP as trained so far
    return {"goal": goal, "tau_per_decade": b, "flops": flops, "slots": slots,
            "more_flops": max(flops - 10 ** last_x, 0.0), "more_slots": max(slots - last_slots, 0.0),
            "points": n}


def projection_text(history: List[Dict], goal: float = GOAL_TAU) -> str:
    p = projection(history, goal)
    if p is None:
        return (f"Projection to τ {goal}: needs at least two evaluations after training started on a rising curve "
                "(none yet).")
    return (f"Projection to τ {goal} (least squares over {p['points']} evaluations, τ = a + b·log10 FLOPs, "
            f"b = {p['tau_per_decade']:.3f} per 10x): {p['flops']:.3g} training FLOPs and {p['slots']:.3g} predicted "
            f"slots in all, {p['more_flops']:.3g} FLOPs and {p['more_slots']:.3g} slots more than so far. A log-linear "
            "fit of a short curve is a rough guide: τ saturates eventually.")


def read_bench(out: Path) -> Optional[BenchFigures]:
    file = Path(out) / BENCH_JSON
    return BenchFigures.from_dict(json.loads(file.read_text())) if file.is_file() else None


def record_bench(out: Path, report_path: Path) -> BenchFigures:
    """Store a bench report's figures next to the drafter (bench.json) and put them into its README.md."""
    out, report_path = Path(out), Path(report_path)
    if not report_path.is_file():
        raise DFlashError(f"bench report '{report_path}' not found: run `dflash-mlx bench ... --out DIR` first (it writes DIR/bench.json)")
    fig = BenchFigures.from_report(json.loads(report_path.read_text()), source=report_path.name)
    (out / BENCH_JSON).write_text(json.dumps(asdict(fig), indent=1) + "\n")
    card = out / "README.md"
    if card.is_file():
        card.write_text(with_section(card.read_text(), bench_section(fig)))
    return fig


def with_section(text: str, section: str) -> str:
    """`text` with its bench section replaced by `section` (inserted before the recipe when there is none)."""
    lines = text.split("\n")
    start = next((i for i, l in enumerate(lines) if l.strip() == BENCH_HEADING), None)
    if start is None:
        at = next((i for i, l in enumerate(lines) if l.startswith("## ")), len(lines))
        return "\n".join(lines[:at] + section.split("\n") + lines[at:])
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[:start] + section.split("\n") + lines[end:])


def recipe_rows(args, config, trainer) -> List[Tuple[str, str]]:
    """(name, value) of every choice that shaped the drafter, as trained."""
    cfg = trainer.config
    return [
        ("draft layers", str(config.num_hidden_layers)),
        ("target layers tapped", f"{config.target_layer_ids} (outputs of those decoder layers, 0-based)"),
        ("block size", str(config.block_size)),
        ("γ (slot weight exp(-(k-1)/γ))", f"{trainer.gamma:g}"),
        ("anchors per row", f"{cfg.anchors} (rows of {trainer.cache.seq_len} tokens)"),
        ("blocks per optimizer step", f"{cfg.accum * cfg.micro_blocks} ({cfg.accum} micro-batch(es) of "
                                      f"{cfg.rows_per_step} row(s) x {cfg.anchors})"),
        ("labels", "the target's own argmax on the text" if cfg.labels == "target" else "the text's next tokens"),
        ("optimizer", f"AdamW (0.9, 0.95), weight decay {cfg.weight_decay:g}"),
        ("learning rate", f"{cfg.lr:g} peak, {cfg.warmup} warmup steps ({cfg.warmup / cfg.steps:.0%}), cosine to "
                          f"{cfg.lr * cfg.min_lr_ratio:g}"),
        ("gradient clip", f"{cfg.grad_clip:g}"),
        ("KL weight (target top-k)", f"{cfg.kl:g}"),
        ("frozen", "the target, its embedding and LM head" + (" (reduced head rows too)"
                                                              if config.draft_vocab_size else "")),
        ("seed", str(cfg.seed)),
    ]


def curve_rows(history: List[Dict]) -> str:
    lines = ["| step | slots seen | training FLOPs | held-out τ | verify passes |", "|---|---|---|---|---|"]
    for h in history:
        flops = h.get("flops")
        lines.append(f"| {h['step']} | {h.get('slots', '?')} | {'?' if flops is None else f'{flops:.3g}'} | "
                     f"{h['tau']:.3f} | {h['passes']} |")
    return "\n".join(lines)


def plot_curve(history: List[Dict], path: Path, title: str) -> Optional[str]:
    """Held-out τ against training FLOPs (and slots seen on the top axis); returns a note instead if it cannot."""
    points = [h for h in history if h.get("flops") is not None]
    if len(points) < 2:
        return "fewer than two evaluations: no curve drawn"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install \"dflash-mlx[bench]\"): no PNG"
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    flops = [max(h["flops"], 1.0) for h in points]
    ax.plot(flops, [h["tau"] for h in points], marker="o")
    ax.set_xscale("symlog", linthresh=min(f for f in flops if f > 1) if any(f > 1 for f in flops) else 1.0)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("held-out τ")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    for h, f in zip(points, flops):
        ax.annotate(f"{h.get('slots', 0):.2g} slots", (f, h["tau"]), fontsize=6, textcoords="offset points",
                    xytext=(2, 4))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write_card(out: Path, args, config, trainer, cache, extraction: Optional[Dict]) -> None:
    """README.md (+ tau_curve.png): purpose, recipe, data, cost and the held-out τ curve."""
    from mlx.utils import tree_flatten

    out = Path(out)
    params = sum(v.size for _, v in tree_flatten(trainer.drafter.trainable_parameters()))
    d = cache.meta.get("data", {})
    ext = cache.meta.get("extraction") or extraction or {}
    vocab = f"draft vocab {config.draft_vocab_size}" if config.draft_vocab_size else "full vocab"
    gen = d.get("generation") or {}
    regenerated = ", answers generated by the target" if d.get("regenerated") else ""
    if gen:
        regenerated += f" ({gen['tokens']} tokens at {gen['tok_s']:.1f} tok/s)"
    rate = trainer.predicted / max(trainer.elapsed, 1e-9)
    rows = [
        ("target", f"`{args.target}` ({config.num_target_layers} layers, hidden {config.hidden_size}, "
                   f"vocab {config.vocab_size})"),
        ("drafter", f"{config.num_hidden_layers} layers, block size {config.block_size}, taps "
                    f"{config.target_layer_ids}, mask token {config.mask_token_id}, {vocab}, "
                    f"{params / 1e6:.1f} M trained parameters, saved as {args.dtype}"),
        ("data", f"{', '.join(d.get('sources', args.data))}: {d.get('files', '?')} files, "
                 f"{d.get('documents', '?')} documents, {cache.rows} rows x {cache.seq_len} tokens, "
                 f"{d.get('trainable_tokens', '?')} trainable{regenerated}; {len(cache.eval_prompts)} held-out "
                 "documents for τ"),
        ("features", f"{ext.get('tokens', '?')} tokens in {ext.get('seconds', 0):.0f} s"),
        ("training", f"{trainer.step} steps on {getattr(trainer, 'device', '?')}; {trainer.elapsed:.0f} s "
                     f"({trainer.elapsed / 3600:.2f} h); {trainer.context_tokens} context tokens, "
                     f"{trainer.predicted} predicted slots ({rate:.0f} slots/s), {trainer.flops:.3g} FLOPs"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    recipe = "\n".join(f"| {k} | {v} |" for k, v in recipe_rows(args, config, trainer))
    note = plot_curve(trainer.history, out / CURVE_PNG, f"{Path(args.target).name}: held-out τ at B={config.block_size}")
    figure = f"![held-out τ against training FLOPs]({CURVE_PNG})" if note is None else f"(Curve: {note}.)"
    bench = read_bench(out)
    bench_text = bench_section(bench) + "\n" if bench else ""
    text = f"""# DFlash drafter for `{Path(args.target).name}`

Trained with `dflash-mlx train`. Load it with `dflash_mlx.load(TARGET, drafter=THIS_DIR)` or
`dflash-mlx generate --model TARGET --draft THIS_DIR`.

| | |
|---|---|
{table}

{bench_text}## Recipe

| | |
|---|---|
{recipe}

## Held-out τ against compute

Greedy DFlash with the engine's own loop at block size {config.block_size}, {args.eval_tokens} new tokens per
held-out prompt; FLOPs count the drafter's training matmuls (forward and backward).

{curve_rows(trainer.history)}

{figure}

{projection_text(trainer.history)}

Command:

    {args.command_line()}
"""
    (out / "README.md").write_text(text)


def main(argv: Optional[List[str]] = None) -> int:
    """python -m dflash_mlx.train.card DRAFTER_DIR BENCH_REPORT.json: put the bench figures into the card."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dflash_mlx.train.card DRAFTER_DIR BENCH_REPORT.json", file=sys.stderr)
        return 2
    try:
        fig = record_bench(Path(argv[0]), Path(argv[1]))
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{argv[0]}: τ {fig.tau_fixed:.2f} at B={fig.block_size}, {fig.speedup_adaptive:.2f}x with the adaptive "
          "width")
    return 0


if __name__ == "__main__":
    sys.exit(main())
