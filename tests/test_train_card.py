"""The model card's bench section and τ projection (train/card.py): figures picked out of a bench report, the
section put into an existing card and replaced on a second run, and the compute the curve predicts for τ 3.5."""

from __future__ import annotations

import json
import math

import pytest

from dflash_mlx.errors import DFlashError
from dflash_mlx.train.card import BENCH_HEADING, BenchFigures, main, projection, read_bench, with_section


def _report(tau16=1.4, speedup=1.2):
    return {"methods": [
        {"name": "mlx-lm", "kind": "mlx-lm", "block": 1, "prompts": 20, "tok_s": 10.0, "speedup": 1.0, "tau": 1.0,
         "identical": 20},
        {"name": "dflash B=16", "kind": "dflash", "block": 16, "prompts": 20, "tok_s": 9.0, "speedup": 0.9,
         "tau": tau16, "identical": 20},
        {"name": "dflash adaptive", "kind": "dflash", "block": 16, "prompts": 20, "tok_s": 10 * speedup,
         "speedup": speedup, "tau": 1.3, "identical": 19},
    ]}


def test_bench_figures_from_a_report():
    fig = BenchFigures.from_report(_report(), "bench.json")
    assert (fig.block_size, fig.tau_fixed, fig.tau_adaptive, fig.speedup_adaptive) == (16, 1.4, 1.3, 1.2)
    assert (fig.plain_tok_s, fig.adaptive_tok_s, fig.identical) == (10.0, 12.0, "19/20")
    with pytest.raises(DFlashError, match="adaptive"):
        BenchFigures.from_report({"methods": _report()["methods"][:2]})


def test_record_bench_puts_the_section_into_the_card_and_replaces_it(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# Drafter\n\n| | |\n|---|---|\n| target | x |\n\n## Recipe\n\nrecipe\n")
    report = tmp_path / "bench.json"
    report.write_text(json.dumps(_report()))
    assert main([str(tmp_path), str(report)]) == 0
    text = card.read_text()
    assert text.index(BENCH_HEADING) < text.index("## Recipe") and "| τ at B=16 (every cycle verifies the block) | 1.40 |" in text
    report.write_text(json.dumps(_report(tau16=2.5, speedup=1.6)))
    assert main([str(tmp_path), str(report)]) == 0
    text = card.read_text()
    assert text.count(BENCH_HEADING) == 1 and "| 2.50 |" in text and "1.60x plain greedy" in text
    assert "| 1.40 |" not in text and text.endswith("## Recipe\n\nrecipe\n")
    assert read_bench(tmp_path).tau_fixed == 2.5  # a card written later (write_card) shows the same figures
    assert with_section(text, "## On the bench\n\nnew\n").count("new") == 1
    assert main([str(tmp_path), str(tmp_path / "missing.json")]) == 1


def test_projection_extends_the_log_linear_curve():
    # τ = 1 + 0.5 * log10(FLOPs / 1e12): τ 3.5 at 1e17 FLOPs; 1e6 slots per 1e12 FLOPs.
    history = [{"step": 0, "slots": 0, "flops": 0.0, "tau": 1.0}]
    history += [{"step": i, "slots": 10 ** (6 + i), "flops": 10.0 ** (12 + i), "tau": 1 + 0.5 * i} for i in (1, 2, 3)]
    p = projection(history)
    assert p["tau_per_decade"] == pytest.approx(0.5)
    assert math.log10(p["flops"]) == pytest.approx(17)
    assert p["slots"] == pytest.approx(1e11, rel=1e-6) and p["more_slots"] == pytest.approx(1e11 - 1e9, rel=1e-6)
    assert projection(history[:2]) is None  # one point after the start
    flat = [dict(h, tau=2.0) for h in history]
    assert projection(flat) is None  # no rising line: no prediction
