"""`dflash-mlx train` never harms what is not its own: an --out holding a model or foreign files is refused, a
resume writes only into the --out it is given (with the --target given, checked to be the trained model), and bad
options fail in one line before the target is loaded. Tiny in-code targets; every failure is one `error:` line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tiny import training_pair

    root = tmp_path_factory.mktemp("hardening-train")
    return (*training_pair(root), root)


def _argv(target, data, out, *extra):
    return ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "2",
            "--block-size", "4", "--num-layers", "2", "--anchors", "8", "--batch-blocks", "8", "--seq-len", "48",
            "--eval-prompts", "1", "--eval-every", "0", "--eval-tokens", "4", "--checkpoint-every", "1",
            "--no-compile", *[str(x) for x in extra]]


def _run(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str) -> str:
    """The single `error:` line of a failed command (and no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _snapshot(folder: Path):
    """Every file and folder under `folder`, with each file's SHA-256: equal snapshots mean byte-for-byte equal."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def finished(world):
    """A finished two-step run, trained into a folder that existed and was empty (which is fine)."""
    target_dir, data, root = world
    out = root / "A"
    out.mkdir()
    assert main(_argv(target_dir, data, out)) == 0
    assert json.loads((out / "train_state" / "latest.json").read_text())["step"] == 2
    return out


# -- 1. --out must be new, empty, or a run of ours --------------------------------------------------------------------
def _model_copy(world, folder: Path) -> None:
    shutil.copytree(world[0], folder)  # a target: config.json, model.safetensors, tokenizer files


def _drafter_like(world, folder: Path) -> None:
    folder.mkdir()  # what `convert` writes: a model, but no training run made it
    (folder / "config.json").write_text('{"model_type": "qwen3"}\n')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)


def _notes(world, folder: Path) -> None:
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")


def _foreign_features(world, folder: Path) -> None:
    (folder / "features").mkdir(parents=True)
    (folder / "features" / "photo.jpg").write_bytes(b"\xff\xd8")


@pytest.mark.parametrize("make,needle", [(_model_copy, "holds a model"), (_drafter_like, "holds a model"),
                                         (_notes, "notes.txt"), (_foreign_features, "features")],
                         ids=["target", "drafter", "notes", "features"])
def test_out_holding_a_model_or_foreign_files_is_refused(world, capsys, tmp_path, make, needle):
    target_dir, data, _ = world
    out = tmp_path / "out"
    make(world, out)
    before = _snapshot(out)
    code, _, err = _run(capsys, _argv(target_dir, data, out))
    line = _one_error(err)
    assert code == 2 and needle in line and str(out) in line, line
    assert _snapshot(out) == before
    code, _, err = _run(capsys, _argv(target_dir, data, out, "--resume"))  # not resumable either
    assert code == 2 and _snapshot(out) == before, err
    _one_error(err)


def test_the_target_folder_itself_is_never_overwritten(world, capsys):
    target_dir, data, _ = world
    before = _snapshot(target_dir)
    code, _, err = _run(capsys, _argv(target_dir, data, target_dir))
    assert code == 2 and "holds a model" in _one_error(err)
    assert _snapshot(target_dir) == before


# -- 2. a resume continues in the --out given, with the --target given ------------------------------------------------
def _state(run: Path):
    return json.loads((run / "train_state" / json.loads((run / "train_state" / "latest.json").read_text())["dir"]
                       / "trainer.json").read_text())


def _legacy(run: Path) -> None:
    """Make `run` look like one written before run markers and target fingerprints."""
    for marker in run.glob(".dflash-train*"):
        marker.unlink()
    step = run / "train_state" / json.loads((run / "train_state" / "latest.json").read_text())["dir"]
    state = json.loads((step / "trainer.json").read_text())
    state.pop("target_identity", None)
    (step / "trainer.json").write_text(json.dumps(state))


@pytest.mark.parametrize("legacy", [False, True], ids=["marked", "legacy"])
def test_resuming_a_copy_writes_only_into_the_copy(world, finished, capsys, tmp_path, legacy):
    target_dir, data, _ = world
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    if legacy:
        _legacy(copy)
    moved = tmp_path / "moved-target"  # the same model at another path is accepted and used
    shutil.copytree(target_dir, moved)
    original = _snapshot(finished)
    code, _, err = _run(capsys, _argv(moved, data, copy, "--resume", "--steps", "3"))
    assert code == 0, err
    assert _snapshot(finished) == original  # byte for byte
    state = _state(copy)
    assert state["step"] == 3 and state["args"]["out"] == str(copy) and state["args"]["target"] == str(moved)
    assert (copy / "model.safetensors").is_file() and str(moved) in (copy / "README.md").read_text()


@pytest.mark.parametrize("legacy", [False, True], ids=["marked", "legacy"])
def test_resuming_with_another_model_is_refused(world, finished, capsys, tmp_path, legacy):
    target_dir, data, _ = world
    other, _ = make_tiny_pair(tmp_path / "other", seed=1)  # same shapes, other weights
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    if legacy:
        _legacy(copy)
    original, mine = _snapshot(finished), _snapshot(copy)
    code, _, err = _run(capsys, _argv(other, data, copy, "--resume", "--steps", "3"))
    line = _one_error(err)
    assert code == 2 and str(other) in line and str(target_dir) in line, line
    assert _snapshot(finished) == original and _snapshot(copy) == mine


def test_a_damaged_checkpoint_pointer_is_one_line(world, finished, capsys, tmp_path):
    target_dir, data, _ = world
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / "train_state" / "latest.json").write_text('{"step": 2, "di')  # cut short by a crash or a full disk
    mine = _snapshot(copy)
    code, _, err = _run(capsys, _argv(target_dir, data, copy, "--resume", "--steps", "3"))
    assert code == 2 and "latest.json" in _one_error(err) and _snapshot(copy) == mine


# -- 4. options are checked before any work ---------------------------------------------------------------------------
BAD_OPTIONS = [
    (["--num-layers", "0"], "--num-layers"),
    (["--seq-len", "0"], "--seq-len"),
    (["--seq-len", "5"], "--seq-len"),  # shorter than a block of 4 plus its context
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-0.001"], "--lr"),
    (["--gamma", "0"], "--gamma"),
    (["--gamma", "-2"], "--gamma"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--max-minutes", "0"], "--max-minutes"),
    (["--max-minutes", "-5"], "--max-minutes"),
    (["--regenerate", "-1"], "--regenerate"),
    (["--eval-prompts", "-1"], "--eval-prompts"),
    (["--block-size", "1"], "--block-size"),
    (["--kl", "1.5"], "--kl"),
    (["--kl", "-0.1"], "--kl"),
    (["--labels", "teacher"], "--labels"),
    (["--draft-vocab", "0"], "--draft-vocab"),
    (["--mask-token-id", "-1"], "--mask-token-id"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--steps", "0", "--resume"], "--steps"),
    (["--target-layers", "0,9"], "--target-layers"),  # the tiny target has 4 layers
    (["--target-layers", "-1,2"], "--target-layers"),
]


@pytest.mark.parametrize("extra,flag", BAD_OPTIONS, ids=[" ".join(e) for e, _ in BAD_OPTIONS])
def test_bad_options_fail_in_one_line_before_any_work(world, capsys, tmp_path, monkeypatch, extra, flag):
    import dflash_mlx.train.session as session
    import dflash_mlx.train.data as data_module

    target_dir, data, _ = world
    if flag != "--target-layers":  # every other check needs no target: it must come before loading one
        monkeypatch.setattr(session, "load_training_target", lambda *a: pytest.fail("the target was loaded"))
    monkeypatch.setattr(data_module, "prepare_data", lambda *a, **k: pytest.fail("the data was read"))
    out = tmp_path / "out"
    argv = _argv(target_dir, data, out)
    i = argv.index(extra[0]) if extra[0] in argv else None
    if i is not None:
        del argv[i:i + 2]  # the base command's own value of this flag
    code, _, err = _run(capsys, argv + extra)
    line = _one_error(err)
    assert code == 2 and flag in line, line
    assert not out.exists()
