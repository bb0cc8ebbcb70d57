"""`dflash-mlx convert` never destroys or strands data: an output folder that overlaps the source, or is the current,
home or root folder, is refused in one line; SIGTERM / Ctrl-C mid-write and a killed run leave no hidden partial
folder behind; results get the user's umask, not tempfile's 0700 / 0600; wrong kinds of path are named as such.

Every entry is covered: the z-lab drafter converter, `--gguf` and `--target`, on tiny inputs built in code.
"""

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.io_safety import output_dir, write_text_atomic

from test_gguf import CONFIGS, _export, _tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return _export(_tiny("qwen2"), CONFIGS["qwen2"], "qwen2", tmp_path_factory.mktemp("gguf") / "m.gguf")


def _run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err):
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line and "tensor/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _sources(kind, pair, gguf_file, parent):
    """(the source inside `parent`, the convert arguments before OUT) for each converter entry."""
    parent.mkdir()
    if kind == "gguf":
        src = parent / "m.gguf"
        shutil.copy(gguf_file, src)
        return src, ["convert", "--gguf", src]
    src = parent / "src"
    shutil.copytree(pair[0] if kind == "target" else pair[1], src)
    return src, (["convert", "--target", src] if kind == "target" else ["convert", src])


# -- 1. outputs that overlap the source, or are the current, home or root folder ---------------------------------
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["drafter", "gguf", "target"])
def test_output_holding_the_source_is_refused(pair, gguf_file, tmp_path, capsys, kind, force):
    parent = tmp_path / "parent"
    src, args = _sources(kind, pair, gguf_file, parent)
    before = _tree(tmp_path)
    extra = ["--dtype", "fp16"] + (["--force"] if force else [])
    code, _, err = _run(capsys, *args, parent, *extra)
    line = _one_line(err)
    assert code == 2 and "holds the source" in line and str(src) in line, line
    assert _tree(tmp_path) == before  # the source is still there, and nothing was added next to it


@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_output_inside_or_equal_to_the_source_is_refused(pair, gguf_file, tmp_path, capsys, kind):
    src, args = _sources(kind, pair, gguf_file, tmp_path / "parent")
    before = _tree(tmp_path)
    for out, needle in ((src / "sub", "is inside the source directory"), (src, "is the source directory")):
        for force in ([], ["--force"]):
            code, _, err = _run(capsys, *args, out, "--dtype", "fp16", *force)
            assert code == 2 and needle in _one_line(err), err
    assert _tree(tmp_path) == before


def test_gguf_output_equal_to_the_file_is_refused(gguf_file, tmp_path, capsys):
    src = tmp_path / "m.gguf"
    shutil.copy(gguf_file, src)
    code, _, err = _run(capsys, "convert", "--gguf", src, src, "--force")
    assert code == 2 and "is the source file" in _one_line(err)
    assert src.read_bytes() == gguf_file.read_bytes()


@pytest.mark.parametrize("kind", ["drafter", "gguf", "target"])
def test_current_home_and_root_folders_are_refused(pair, gguf_file, tmp_path, capsys, monkeypatch, kind):
    # A sandbox: the current folder is tmp/work/here, the home folder tmp/home; '..' is tmp/work.
    here, home = tmp_path / "work" / "here", tmp_path / "home"
    here.mkdir(parents=True)
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    source = {"drafter": pair[1], "gguf": gguf_file, "target": pair[0]}[kind]
    args = {"drafter": ["convert", source], "gguf": ["convert", "--gguf", source],
            "target": ["convert", "--target", source]}[kind]
    before = _tree(tmp_path)
    cases = [(".", "is the current folder"), (str(here), "is the current folder"), ("..", "holds the current folder"),
             ("~", "is your home folder"), ("/", "is a filesystem root")]
    for out, needle in cases:
        for force in ([], ["--force"]) if out != "/" else ([],):  # never try to replace / itself
            code, _, err = _run(capsys, *args, out, "--dtype", "fp16", *force)
            line = _one_line(err)
            assert code == 2 and needle in line, (out, force, line)
    assert _tree(tmp_path) == before  # no stray '..XXXX.old' or partial folder anywhere


# -- 2. signals mid-write and killed runs -----------------------------------------------------------------------
_SLOW_CONVERT = """
import sys, time
import dflash_mlx.convert.drafter as drafter

real = drafter.save_drafter

def slow(model, out):  # every file written into the partial folder, then a pause before it is renamed into place
    real(model, out)
    print("written", flush=True)
    time.sleep(60)

drafter.save_drafter = slow
from dflash_mlx.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env():
    return dict(os.environ, DFLASH_MLX_NO_BLAS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _convert_until_written(src, out):
    """A `convert SRC OUT` subprocess, returned once its partial folder holds the whole result."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, "convert", str(src), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    text, deadline = b"", time.time() + 60
    while b"written" not in text and time.time() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            text += os.read(proc.stdout.fileno(), 4096)
    if b"written" not in text:
        proc.kill()
        pytest.fail(f"the conversion did not reach its write: {proc.communicate()[1].decode(errors='replace')}")
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_convert_leaves_nothing(pair, tmp_path, signum):
    out = tmp_path / "out"
    proc = _convert_until_written(pair[1], out)
    assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())  # the write is under way
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    err = err.decode(errors="replace")
    assert proc.returncode == 130, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.strip() and "tensor/s]" not in line]  # progress bars
    assert lines == ["interrupted"] and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # no hidden .out.*.partial folder, no output


def test_a_killed_runs_partial_folder_goes_at_the_next_run(pair, tmp_path, capsys):
    out = tmp_path / "out"
    proc = _convert_until_written(pair[1], out)
    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=30)
    stale = [p.name for p in tmp_path.iterdir()]
    assert len(stale) == 1 and stale[0].startswith(".out.") and stale[0].endswith(".partial"), stale
    # Folders that are not ours, or belong to a conversion still running, must stay.
    keep = [".out.keep", ".other.123.0123abcd.partial", f".out.{os.getppid()}.0123abcd.partial", "outer"]
    for name in keep:
        (tmp_path / name).mkdir()
    code, _, err = _run(capsys, "convert", pair[1], out)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["out"])


def test_signal_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with output_dir(tmp_path / "out") as tmp:
        assert signal.getsignal(signal.SIGTERM) is not before  # SIGTERM now unwinds through the cleanup
        (tmp / "x").write_text("x")
    assert signal.getsignal(signal.SIGTERM) is before
    assert (tmp_path / "out" / "x").read_text() == "x"


def test_a_signal_during_the_final_renames_waits_for_them(tmp_path, monkeypatch):
    # Ctrl-C between moving the old folder aside and renaming the new one in would leave neither in place.
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("old")
    real = os.replace

    def replace(src, dst):
        signal.raise_signal(signal.SIGINT)
        real(src, dst)

    with pytest.raises(KeyboardInterrupt):  # delivered once the new folder is in place
        with output_dir(out, force=True) as tmp:
            (tmp / "x").write_text("new")
            monkeypatch.setattr(os, "replace", replace)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "x").read_text() == "new"


# -- 4. modes: the user's umask, like a plain mkdir / open ------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_converted_folder_and_files_follow_the_umask(pair, gguf_file, tmp_path, capsys, umask):
    previous = os.umask(umask)
    try:
        assert _run(capsys, "convert", pair[1], tmp_path / "drafter")[0] == 0
        assert _run(capsys, "convert", "--gguf", gguf_file, tmp_path / "gguf")[0] == 0
        written = write_text_atomic(tmp_path / "notes.json", "{}")
    finally:
        os.umask(previous)
    for folder in (tmp_path / "drafter", tmp_path / "gguf"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder
        for file in folder.iterdir():
            assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask


def test_atomic_rewrite_keeps_the_files_mode(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text("old")
    path.chmod(0o640)
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640


# -- 5. the wrong kind of path is named as such ----------------------------------------------------------------
def test_a_folder_given_to_gguf(tmp_path, capsys):
    code, _, err = _run(capsys, "convert", "--gguf", tmp_path, tmp_path / "out")
    line = _one_line(err)
    assert code == 2 and "is a folder" in line and ".gguf file" in line and "does not exist" not in line


def test_a_file_given_as_a_model_folder(pair, tmp_path, capsys):
    weights = pair[0] / "model.safetensors"
    code, _, err = _run(capsys, "convert", "--target", weights, tmp_path / "out", "--dtype", "fp16")
    line = _one_line(err)
    assert code == 2 and "is a file" in line and "folder" in line and "config.json;" not in line
    code, _, err = _run(capsys, "generate", "-m", weights, "-d", pair[1], "-p", "hi")
    line = _one_line(err)
    assert code == 2 and "is a file" in line and "model's folder" in line, line
    assert not (tmp_path / "out").exists()
