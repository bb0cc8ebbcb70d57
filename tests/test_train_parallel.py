"""Data-parallel training (`dflash-mlx train --workers N`, `mlx.launch ... dflash-mlx train`): ranks on this machine
joined in a ring on 127.0.0.1 train the tiny in-code models.

Checked: every rank ends with the same weights and optimizer state bit for bit (rank 0's, even when they started
from different ones), and they equal a one-process run's to float32 rounding (the same micro-batch gradients,
summed in another grouping); the slot counters are the whole step's; the command trains, resumes and writes a
drafter with several workers; a rank's error reaches the user as one line; the default worker count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.distributed.local import run_local
from dflash_mlx.errors import DFlashError
from dflash_mlx.train.parallel import LocalWorkers, default_workers
from test_train import _trainer, tiny_cache  # noqa: F401 (a fixture)

WORKER = str(Path(__file__).resolve().parent / "train_parallel_worker.py")
LIMIT = 120  # seconds per launch; a hang is killed


def test_ranks_stay_identical_and_match_one_process(tiny_cache):  # noqa: F811
    steps = 3
    results = run_local([sys.executable, WORKER, str(tiny_cache.path), str(steps)], ranks=2, timeout=LIMIT)
    for r in results:
        assert r.returncode == 0, (r.rank, r.stderr[-2000:])
    ranks = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    assert ranks[0]["params"] == ranks[1]["params"] and ranks[0]["opt"] == ranks[1]["opt"]
    assert ranks[0]["stats"] == ranks[1]["stats"]

    single = _trainer(tiny_cache, seed=1, batch_blocks=48)  # rank 0's initial weights, one process
    stats = [single.train_step() for _ in range(steps)]
    assert ranks[0]["predicted"] == single.predicted and ranks[0]["context"] == single.context_tokens
    for mine, ref in zip(ranks[0]["stats"], stats):
        for k in ref:
            assert mine[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), k
    saved = mx.load(str(tiny_cache.path.parent / "rank0.safetensors"))
    from mlx.utils import tree_flatten

    for name, ref in tree_flatten(single.drafter.parameters()):
        np.testing.assert_allclose(np.array(saved[name]), np.array(ref), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def pair_and_data(tmp_path_factory):
    from tiny import training_pair

    return training_pair(tmp_path_factory.mktemp("parallel"))


def _argv(target_dir, data, out, *extra):
    return ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "4",
            "--block-size", "4", "--num-layers", "2", "--anchors", "8", "--batch-blocks", "32", "--seq-len", "64",
            "--eval-prompts", "2", "--eval-every", "2", "--eval-tokens", "8", "--checkpoint-every", "2",
            "--cache", str(out.parent / "features"), *extra]


def test_train_command_with_workers(tmp_path, pair_and_data, capfd):
    from dflash_mlx import load
    from dflash_mlx.cli import main

    target_dir, data = pair_and_data
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(_argv(target_dir, data, one, "--workers", "1")) == 0
    assert main(_argv(target_dir, data, two, "--workers", "2")) == 0
    printed = capfd.readouterr().out
    assert "shared by 2 data-parallel ranks" in printed and "on 2 ranks" in printed
    a = mx.load(str(one / "train_state" / "step-4" / "params.safetensors"))
    b = mx.load(str(two / "train_state" / "step-4" / "params.safetensors"))
    for name in a:
        np.testing.assert_allclose(np.array(b[name]), np.array(a[name]), rtol=1e-4, atol=1e-6, err_msg=name)
    state_one = json.loads((one / "train_state" / "step-4" / "trainer.json").read_text())
    state_two = json.loads((two / "train_state" / "step-4" / "trainer.json").read_text())
    assert state_two["predicted"] == state_one["predicted"] and len(state_two["history"]) == len(state_one["history"])
    assert "2 data-parallel ranks" in (two / "README.md").read_text()
    load(str(target_dir), drafter=str(two))
    # --resume with workers extends the run; a finished run is refused without it, in one line.
    assert main(_argv(target_dir, data, two, "--workers", "2", "--resume", "--steps", "6")) == 0
    assert json.loads((two / "train_state" / "latest.json").read_text())["step"] == 6
    assert main(_argv(target_dir, data, two, "--workers", "2")) == 2
    assert "pass --resume" in capfd.readouterr().err
    assert main(_argv(target_dir, data, tmp_path / "five", "--workers", "5")) == 2  # 4 micro-batches per step
    assert "--workers 5 but only 4 micro-batch" in capfd.readouterr().err


def test_a_rank_error_is_one_line(tmp_path, pair_and_data):
    target_dir, data = pair_and_data
    args = dict(target=str(target_dir), out=str(tmp_path / "empty"), data=[str(data)])
    spec = dict(args=args, resume=True, steps=None, max_minutes=None)  # nothing to resume: every rank refuses
    with pytest.raises(DFlashError, match="nothing to resume"):
        LocalWorkers(2, spec).run()


def test_default_workers():
    gib = 2 ** 30
    assert default_workers("cpu", gib, cores=8, memory=64 * gib) == 8
    assert default_workers("cpu", 8 * gib, cores=8, memory=64 * gib) == 2  # half the memory holds 2 ranks
    assert default_workers("cpu", 80 * gib, cores=8, memory=64 * gib) == 1
    assert default_workers("metal", gib, cores=8, memory=64 * gib) == 1
    assert default_workers("cuda", gib, cores=8, memory=None) == 1


def test_train_under_a_launcher(tmp_path, pair_and_data):
    """As `mlx.launch -n 2 -- dflash-mlx train ...` runs it: rank 0 builds the feature cache, rank 1 then opens it,
    both train; only rank 0 prints and writes."""
    target_dir, data = pair_and_data
    out = tmp_path / "launched"
    argv = [sys.executable, "-m", "dflash_mlx.cli", *_argv(target_dir, data, out)]
    results = run_local(argv, ranks=2, timeout=LIMIT)
    for r in results:
        assert r.returncode == 0, (r.rank, r.stderr[-2000:])
    assert "shared by 2 data-parallel ranks" in results[0].stdout and results[1].stdout == ""
    assert json.loads((out / "train_state" / "latest.json").read_text())["step"] == 4
    assert (out / "model.safetensors").is_file()
    # --workers is for starting ranks here, not under a launcher: one line from rank 0.
    results = run_local(argv + ["--resume", "--workers", "2"], ranks=2, timeout=LIMIT)
    assert results[0].returncode == 2 and "under mlx.launch leave it out" in results[0].stderr
