"""Turn benchmark runs into the report: per-method summary, per-prompt detail, verify cost; JSON, table and chart.

Speedup is the ratio of decode throughput (total new tokens / total decode time over all prompts) to plain
mlx-lm decoding's; τ is the mean number of tokens committed per target pass (docs/algorithm.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import List, Optional

from ..decode.stats import AcceptanceStats
from .methods import PHASES

GB = 1e9


def _first_mismatch(tokens: List[int], reference: List[int]) -> Optional[int]:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _stats(cycles, sources=None) -> AcceptanceStats:
    stats = AcceptanceStats()
    for (accepted, block), source in zip(cycles, sources or [None] * len(cycles)):
        stats.record(accepted, block, source)
    return stats


def summarize(methods, plain_name: str, records: List[dict], greedy: bool = True) -> dict:
    """The report dict: "methods" (one summary each, plain first), "prompts", "verify_cost", "notes"."""
    prompts = []
    for rec in records:
        reference = rec["runs"][plain_name].tokens
        runs = {}
        for name, run in rec["runs"].items():
            stats = _stats(run.cycles, run.sources)
            mismatch = _first_mismatch(run.tokens, reference)
            runs[name] = {
                "tokens": len(run.tokens), "seconds": run.seconds,
                "tok_s": len(run.tokens) / run.seconds if run.seconds else 0.0,
                "tau": stats.tau, "cycles": stats.cycles, "identical": mismatch is None,
                "first_mismatch": mismatch, "peak_memory_gb": run.peak_memory / GB,
                "output": list(run.tokens),  # the token ids, so that two runs (a seed, say) can be compared
            }
            if name in rec["profiled"]:
                runs[name]["phases_s"] = rec["profiled"][name].phases
        prompts.append({
            "id": rec["prompt"].id, "prompt_tokens": len(rec["ids"]), "reference": reference, "runs": runs,
            "verify_cost_ms": {str(k): s * 1e3 for k, s in rec["verify"].items()} if rec["verify"] else None,
        })

    plain_tokens = sum(len(r["runs"][plain_name].tokens) for r in records)
    plain_seconds = sum(r["runs"][plain_name].seconds for r in records)
    step = plain_seconds / sum(r["runs"][plain_name].passes for r in records) if records else 0.0
    plain_tps = plain_tokens / plain_seconds if plain_seconds else 0.0
    summaries = []
    for m in methods:
        runs = [r["runs"][m.name] for r in records]
        tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)
        stats = _stats([c for r in runs for c in r.cycles],
                       [s for r in runs for s in (r.sources or [None] * len(r.cycles))])
        passes = sum(r.passes for r in runs)
        tps = tokens / seconds if seconds else 0.0
        identical = sum(_first_mismatch(r.tokens, rec["runs"][plain_name].tokens) is None
                        for r, rec in zip(runs, records))
        summary = {
            "name": m.name, "kind": m.kind, "block": m.block, "prompts": len(runs), "tokens": tokens,
            "seconds": seconds, "tok_s": tps, "speedup": tps / plain_tps if plain_tps else 0.0,
            "tau": stats.tau, "cycles": stats.cycles,
            "histogram": {str(k): v for k, v in sorted(stats.histogram.items())},
            "widths": {str(k): v for k, v in sorted(stats.widths.items())},  # verify width -> passes
            "sources": stats.source_counts(),  # draft source -> passes and tokens committed
            # One target pass (draft + verify + rollback + host) in units of one plain decode step.
            "cycle_cost_steps": seconds / passes / step if passes and step else None,
            "peak_memory_gb": max(r.peak_memory for r in runs) / GB if runs else 0.0,
            "identical": identical, "identical_fraction": identical / len(runs) if runs else 0.0,
            "phases_ms_per_cycle": None, "phase_fraction": None, "profiled_tok_s": None,
        }
        profiled = [r["profiled"][m.name] for r in records if m.name in r["profiled"]]
        cycles = sum(len(p.cycles) for p in profiled)
        if profiled and cycles:
            totals = {ph: sum(p.phases[ph] for p in profiled) for ph in PHASES}
            whole = sum(totals.values()) or 1.0
            summary["phases_ms_per_cycle"] = {ph: totals[ph] * 1e3 / cycles for ph in PHASES}
            summary["phase_fraction"] = {ph: totals[ph] / whole for ph in PHASES}
            summary["profiled_tok_s"] = sum(len(p.tokens) for p in profiled) / sum(p.seconds for p in profiled)
        summaries.append(summary)

    notes = []
    if not greedy:
        notes.append("sampling (T>0): outputs are random draws, so equality with plain decoding is not expected")
        if any(s["name"].startswith("oracle") for s in summaries):
            notes.append("the oracle proposes plain decoding's output position by position; once a sampled stream "
                         "departs from it, its drafts are wrong, so at T>0 its tau is not the machinery's ceiling")
    else:
        for s in summaries:
            if s["identical"] < s["prompts"]:
                notes.append(f"{s['name']}: output differs from plain decoding on {s['prompts'] - s['identical']} "
                             f"of {s['prompts']} prompts (see prompts[].runs[].first_mismatch)")
    if any(s["phases_ms_per_cycle"] for s in summaries):
        notes.append("phase times come from a separate run that syncs at every phase boundary (slower than the "
                     "timed run: see profiled_tok_s)")
    return {"methods": summaries, "prompts": prompts, "verify_cost": _verify_summary(records), "greedy": greedy,
            "notes": notes}


def _verify_summary(records: List[dict]) -> Optional[dict]:
    """Median over the measured prompts of one k-token target forward, in ms and relative to k = 1."""
    measured = [r["verify"] for r in records if r["verify"]]
    if not measured:
        return None
    ks = sorted(measured[0])
    summary = {
        "prompts": len(measured),
        "context_tokens": [len(r["ids"]) for r in records if r["verify"]],
        "ms": {str(k): statistics.median(m[k] for m in measured) * 1e3 for k in ks},
        "relative": {str(k): statistics.median(m[k] / m[1] for m in measured) for k in ks},
    }
    # One greedy draft of a w-token block, in units of one decode step at the same context.
    drafted = [(r["drafting"], r["verify"][1]) for r in records if r.get("drafting") and r["verify"]]
    if drafted:
        widths = sorted(drafted[0][0])
        summary["draft_ms"] = {str(w): statistics.median(d[w] for d, _ in drafted) * 1e3 for w in widths}
        summary["draft_steps"] = {str(w): statistics.median(d[w] / step for d, step in drafted) for w in widths}
    return summary


def format_table(report: dict) -> str:
    """The summary as a plain-text table, then the verify cost and notes."""
    head = ["method", "tok/s", "speedup", "tau", "cycle/step", "draft", "verify", "rollbk", "host", "peak GB",
            "= plain"]
    rows = []
    for s in report["methods"]:
        ph = s["phases_ms_per_cycle"]
        cost = s["cycle_cost_steps"]
        rows.append([
            s["name"], f"{s['tok_s']:.2f}", f"{s['speedup']:.2f}x", f"{s['tau']:.2f}",
            f"{cost:.2f}" if cost is not None else "-",
            *([f"{ph[p]:.1f}" for p in PHASES] if ph else ["-"] * len(PHASES)),
            f"{s['peak_memory_gb']:.3f}", f"{s['identical']}/{s['prompts']}" if report.get("greedy", True) else "-",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append("draft/verify/rollbk/host: ms per target pass (profiled run); cycle/step: one pass in plain decode "
               "steps")
    for s in report["methods"]:
        if s["kind"] != "mlx-lm" and s["cycles"]:
            hist = " ".join(f"{k}:{v}" for k, v in s["histogram"].items())
            widths = " ".join(f"{k}:{v}" for k, v in s["widths"].items())
            out.append(f"{s['name']}: tokens per pass {hist}; verify widths {widths}")
            if set(s.get("sources", {})) - {"dflash", "plain"}:
                src = ", ".join(f"{k} {v['passes']}/{v['tokens']}" for k, v in s["sources"].items())
                out.append(f"{s['name']}: draft sources (passes/tokens) {src}")
    vc = report.get("verify_cost")
    if vc:
        step = vc["ms"]["1"]
        rel = ", ".join(f"k={k} {r:.2f}x" for k, r in vc["relative"].items() if k != "1")
        out.append(f"verify cost vs one decode step ({step:.1f} ms, median of {vc['prompts']} prompts): {rel}")
        if vc.get("draft_steps"):
            drafting = ", ".join(f"B={w} {r:.3f} steps ({vc['draft_ms'][w]:.1f} ms)"
                                 for w, r in vc["draft_steps"].items())
            out.append(f"drafting cost per block, in decode steps: {drafting}")
    if report.get("communication"):  # bench --distributed
        from ..distributed.bench import format_communication

        out += format_communication(report["communication"])
    out += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(out)


def write_json(report: dict, path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def write_chart(report: dict, path: Path) -> Optional[Path]:
    """Throughput, τ, phase split and verify cost in one PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    methods = report["methods"]
    names = [s["name"] for s in methods]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8 + 0.12 * max(0, len(names) - 6)))  # room for more labels
    ax = axes[0][0]
    bars = ax.bar(names, [s["tok_s"] for s in methods], color="tab:blue")
    for bar, s in zip(bars, methods):
        ax.annotate(f"{s['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_title("decode tok/s (speedup vs plain mlx-lm)")
    ax = axes[0][1]
    ax.bar(names, [s["tau"] for s in methods], color="tab:green")
    ax.bar(names, [s["block"] for s in methods], fill=False, edgecolor="gray", linestyle="--", label="tokens verified")
    ax.set_title("τ: tokens committed per target pass")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    profiled = [s for s in methods if s["phases_ms_per_cycle"]]
    if profiled:
        bottom = [0.0] * len(profiled)
        for phase in PHASES:
            values = [s["phases_ms_per_cycle"][phase] for s in profiled]
            ax.bar([s["name"] for s in profiled], values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "no DFlash method profiled\n(--no-profile, or no DFlash method run)",
                ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title("ms per target pass, by phase (profiled run)")
    ax = axes[1][1]
    vc = report.get("verify_cost")
    if vc:
        ks = [int(k) for k in vc["relative"]]
        ax.plot(ks, [vc["relative"][str(k)] for k in ks], marker="o", label="measured")
        ax.plot(ks, ks, linestyle=":", color="gray", label="k x one step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.legend(fontsize=8)
        ax.set_xlabel("k")
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "verify cost not measured\n(--verify-prompts 0)", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.set_title("k-token verify cost / one decode step")
    for ax in axes[0].tolist() + [axes[1][0]]:
        # Long method names: each label ends under its own bar (anchored at its right end).
        ax.tick_params(axis="x", labelsize=8)
        for label in ax.get_xticklabels():
            label.set(rotation=35, ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
