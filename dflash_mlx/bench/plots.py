"""`dflash-mlx bench --plot DIR`: the report as four PNGs, one question each.

- speed.png: each method's decode speed over plain mlx-lm decoding's, prompt by prompt;
- tau.png: how many tokens a verify pass committed (the distribution behind τ), per method;
- acceptance.png: the share of passes whose i-th draft token was accepted, by draft position i;
- widths.png: the verify widths each method's passes chose.

Drawn with matplotlib (the `bench` extra). A report already written can be drawn again:
`python -m dflash_mlx.bench.plots bench.json DIR`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List

from ..errors import DFlashError

MISSING = "--plot draws with matplotlib, which is not installed: pip install 'dflash-mlx[bench]'"


def require_matplotlib():
    """pyplot on the Agg backend (files only, no display), or one clear error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError(MISSING) from None
    return plt


def _drafting(report: dict) -> List[dict]:
    """The methods with verify passes to show (plain mlx-lm decoding has none)."""
    return [s for s in report["methods"] if s["kind"] != "mlx-lm" and s.get("cycles")]


def _plain_name(report: dict) -> str:
    return report["methods"][0]["name"]


def _grouped_bars(ax, labels: List[str], series: Dict[str, List[float]]) -> None:
    n = max(1, len(series))
    width = 0.8 / n
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=name)
    long = max((len(label) for label in labels), default=0) > 3  # prompt ids slant; numbers stand upright
    ax.set_xticks(range(len(labels)), labels, rotation=30 if long else 0, ha="right" if long else "center",
                  fontsize=8)


def plot_speed(plt, report: dict, path: Path) -> Path:
    plain = _plain_name(report)
    prompts = report["prompts"]
    labels = [str(p["id"]) for p in prompts]
    series = {}
    for s in report["methods"][1:]:
        series[s["name"]] = [p["runs"][s["name"]]["tok_s"] / p["runs"][plain]["tok_s"]
                             if p["runs"][plain]["tok_s"] else 0.0 for p in prompts]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(labels) + 4), 4.5))
    _grouped_bars(ax, labels, series)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label=f"{plain} (1x)")
    ax.set_ylabel("decode speed / plain decoding")
    ax.set_title("Speed of each method against plain decoding, per prompt")
    ax.legend(fontsize=8, ncol=2)
    return _save(plt, fig, path)


def plot_tau(plt, report: dict, path: Path) -> Path:
    methods = _drafting(report)
    longest = max((int(k) for s in methods for k in s["histogram"]), default=1)
    labels = [str(n) for n in range(1, longest + 1)]
    series = {}
    for s in methods:
        total = sum(s["histogram"].values()) or 1
        series[f"{s['name']} (τ {s['tau']:.2f})"] = [s["histogram"].get(k, 0) / total for k in labels]
    fig, ax = plt.subplots(figsize=(max(7, 0.45 * longest + 4), 4.5))
    _grouped_bars(ax, labels, series)
    ax.set_xlabel("tokens committed by one verify pass (accepted drafts + 1)")
    ax.set_ylabel("share of passes")
    ax.set_title("τ distribution: tokens per verify pass")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def acceptance_by_position(histogram: Dict[str, int]) -> List[float]:
    """From {tokens committed per pass: passes}, the share of passes that accepted draft i, for i = 1, 2, ...:
    draft i was accepted when the pass committed more than i tokens."""
    hist = {int(k): v for k, v in histogram.items()}
    total = sum(hist.values())
    if not total:
        return []
    return [sum(v for length, v in hist.items() if length > i) / total for i in range(1, max(hist))]


def plot_acceptance(plt, report: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for s in _drafting(report):
        shares = acceptance_by_position(s["histogram"])
        if shares:
            ax.plot(range(1, len(shares) + 1), shares, marker="o", markersize=3, label=s["name"])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of passes that accepted draft i")
    ax.set_ylim(0, 1.02)
    ax.set_title("Accepted length by draft position")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_widths(plt, report: dict, path: Path) -> Path:
    methods = _drafting(report)
    widths = sorted({int(k) for s in methods for k in s["widths"]})
    labels = [str(w) for w in widths]
    series = {}
    for s in methods:
        total = sum(s["widths"].values()) or 1
        series[s["name"]] = [s["widths"].get(k, 0) / total for k in labels]
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(labels) + 4), 4.5))
    _grouped_bars(ax, labels, series)
    ax.set_xlabel("verify width (tokens the target checked in one pass; 1 = a plain decoding step)")
    ax.set_ylabel("share of passes")
    ax.set_title("Verify widths chosen")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, folder) -> List[Path]:
    """The four PNGs in `folder` (created), in the order the module's docstring gives."""
    plt = require_matplotlib()
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return [plot(plt, report, folder / name) for plot, name in
            ((plot_speed, "speed.png"), (plot_tau, "tau.png"), (plot_acceptance, "acceptance.png"),
             (plot_widths, "widths.png"))]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m dflash_mlx.bench.plots bench.json OUT_DIR", file=sys.stderr)
        return 2
    try:
        report = json.loads(Path(args[0]).read_text())
        for path in write_plots(report, args[1]):
            print(f"wrote {path}")
    except (OSError, ValueError, KeyError, DFlashError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
