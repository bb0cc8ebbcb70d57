"""`dflash-mlx models` and `ensure_offline_model` end to end, offline: a tiny GGUF split across two local wheels
stands in for a registry model (pip installs wheel files without a network), in a throwaway $DFLASH_MLX_HOME.
"""

import base64
import hashlib
import json
import zipfile

import dflash_mlx  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from dflash_mlx.models import offline as models
from dflash_mlx.cli import main
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.offline import OfflineModel, ensure_offline_model

from test_gguf import CONFIGS, _export, _tiny


def _wheel(folder, name, files):
    """A minimal wheel holding `files` ({path: bytes}) with a correct RECORD."""
    dist = f"{name}-0.1.0.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    path = folder / f"{name}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in files.items():
            z.writestr(p, data)
    return path


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """A registry model 'tiny-llama' made of two wheels, and an empty cache home."""
    gguf = _export(_tiny("llama"), CONFIGS["llama"], "llama", tmp_path / "tiny.gguf").read_bytes()
    half = len(gguf) // 2
    wheels = [_wheel(tmp_path, f"tiny_part{i + 1}", {f"tiny_part{i + 1}/data/part{i:02d}.bin": chunk})
              for i, chunk in enumerate((gguf[:half], gguf[half:]))]
    model = OfflineModel("tiny-llama", "Tiny llama (test)", "llama", tuple(str(w) for w in wheels),
                         ("tiny_part1/data/part00.bin", "tiny_part2/data/part01.bin"),
                         hashlib.sha256(gguf).hexdigest(), len(gguf), "test")
    monkeypatch.setitem(models.OFFLINE_MODELS, model.name, model)
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    return model


def test_list_shows_every_model(fake, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m", "tiny-llama"):
        assert name in out
    assert "not installed" in out


def test_install_is_idempotent(fake, capsys, monkeypatch):
    assert main(["models", "path", "tiny-llama"]) == 2  # not installed yet
    assert "models install tiny-llama" in capsys.readouterr().err
    assert main(["models", "install", "tiny-llama"]) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1]
    config = json.loads(open(f"{path}/config.json").read())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert not (models.home() / "packages" / "tiny-llama").exists()  # pip's copy is dropped once assembled
    assert models.gguf_path(fake).stat().st_size == fake.size
    # A second call must not install or convert anything.
    monkeypatch.setattr(models, "_pip_install", lambda *a, **k: pytest.fail("installed twice"))
    monkeypatch.setattr("dflash_mlx.convert.gguf.convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert str(ensure_offline_model("tiny-llama")) == path
    assert main(["models", "path", "tiny-llama"]) == 0
    assert "installed: tiny-llama" in (capsys.readouterr(), main(["models"]), capsys.readouterr().out)[2]


def test_variants_reuse_the_gguf(fake, monkeypatch):
    ensure_offline_model("tiny-llama", progress=False, quiet=True)
    monkeypatch.setattr(models, "_pip_install", lambda *a, **k: pytest.fail("installed twice"))
    q8 = ensure_offline_model("tiny-llama", q_bits=8, q_group_size=32, progress=False)
    assert q8.name == "tiny-llama-q8g32"
    assert json.loads((q8 / "config.json").read_text())["quantization"]["bits"] == 8


def test_checksum_mismatch_is_refused(fake, monkeypatch):
    bad = OfflineModel(**{**fake.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(models.OFFLINE_MODELS, fake.name, bad)
    with pytest.raises(DFlashError, match="sha256"):
        ensure_offline_model("tiny-llama", progress=False, quiet=True)
    assert not models.gguf_path(bad).exists() and not models.model_dir(bad).exists()


def test_unknown_name_and_failed_pip_are_one_line(fake, tmp_path, monkeypatch, capsys):
    assert main(["models", "install", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown offline model" in err and "smollm2-135m" in err
    broken = OfflineModel(**{**fake.__dict__, "packages": (str(tmp_path / "missing.whl"),)})
    monkeypatch.setitem(models.OFFLINE_MODELS, fake.name, broken)
    assert main(["models", "install", "tiny-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: pip could not install")


def test_full_disk_while_assembling_is_one_line(fake, monkeypatch, capsys):
    import builtins
    import errno
    import os

    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).endswith(".gguf.partial"):
            def write(_data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            handle.write = write
        return handle

    monkeypatch.setattr(models, "open", full_disk_open, raising=False)
    assert main(["models", "install", "tiny-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot write") and "no space left" in err
    assert not models.gguf_path(fake).exists()
    assert not models.gguf_path(fake).with_name("tiny-llama.gguf.partial").exists()


def test_part_that_differs_from_its_record_is_one_line(fake, monkeypatch):
    """A part whose bytes differ from its wheel's RECORD names the packages folder to delete (not a NameError)."""
    real = models._record

    def tampered(target):
        return {rel: ("0" * 64, size) for rel, (_, size) in real(target).items()}

    monkeypatch.setattr(models, "_record", tampered)
    with pytest.raises(DFlashError, match="does not match its package RECORD.*delete .*packages"):
        ensure_offline_model("tiny-llama", progress=False, quiet=True)
    assert not models.gguf_path(fake).exists()
