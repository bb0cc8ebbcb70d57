"""`dflash-mlx bench --plot DIR` on the tiny demo pair: four PNGs from a real run, redrawn from bench.json too;
without matplotlib, one clear line before any run."""

import json
import sys

import pytest

from dflash_mlx.bench.plots import MISSING, acceptance_by_position, main as plots_main, require_matplotlib
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError

PNG = b"\x89PNG\r\n\x1a\n"
NAMES = ["speed.png", "tau.png", "acceptance.png", "widths.png"]


def test_acceptance_by_position():
    # 4 passes committed 1, 1, 3 and 5 tokens: drafts 1-2 accepted by two of them, drafts 3-4 by one.
    assert acceptance_by_position({"1": 2, "3": 1, "5": 1}) == [0.5, 0.5, 0.25, 0.25]
    assert acceptance_by_position({"1": 7}) == [] and acceptance_by_position({}) == []


def test_bench_plot_writes_the_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    target, drafter = make_tiny_pair(tmp_path / "pair", block_size=4)
    out, plots = tmp_path / "out", tmp_path / "plots"
    code = main(["bench", "--model", str(target), "--draft", str(drafter), "--prompts", "editing", "--num-prompts",
                 "2", "--max-tokens", "12", "--no-profile", "--verify-prompts", "0", "--no-fixed-draft",
                 "--out", str(out), "--plot", str(plots)])
    assert code == 0
    for name in NAMES:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    report = json.loads((out / "bench.json").read_text())
    assert sorted(report["files"]) == sorted(["json", "png", "speed", "tau", "acceptance", "widths"])
    again = tmp_path / "again"
    assert plots_main([str(out / "bench.json"), str(again)]) == 0
    assert sorted(p.name for p in again.iterdir()) == sorted(NAMES)


def test_without_matplotlib_one_line_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(DFlashError, match="pip install 'dflash-mlx\\[bench\\]'"):
        require_matplotlib()
    assert main(["bench", "--model", str(tmp_path / "no-such-model"), "--draft", "lookup",
                 "--plot", str(tmp_path / "p")]) != 0
    assert MISSING in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
