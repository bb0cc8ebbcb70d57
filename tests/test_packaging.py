"""Packaging: `convert/` and `metal/` ship as dflash_mlx.convert and dflash_mlx.metal from both an editable install
and a wheel, and the offline demo pair loads like real models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "dflash_mlx", "convert", "metal"]


def _inside(path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def test_editable_install_maps_subpackages_to_repo_folders():
    import dflash_mlx.convert
    import dflash_mlx.metal

    hint = "the editable install does not point at this checkout; run `pip install -e .[dev]` here"
    assert _inside(dflash_mlx.convert.__file__, REPO / "convert"), hint
    assert _inside(dflash_mlx.metal.__file__, REPO / "metal"), hint
    assert dflash_mlx.metal.read_source("dflash_common.h") == (REPO / "metal" / "dflash_common.h").read_text()
    scripts = metadata.entry_points(group="console_scripts", name="dflash-mlx")
    assert [ep.value for ep in scripts] == ["dflash_mlx.cli:main"]


def test_metal_switches(monkeypatch):
    from dflash_mlx import metal

    monkeypatch.setenv(metal.NO_METAL_ENV, "1")
    assert metal.available() is False
    with pytest.raises(FileNotFoundError):
        metal.read_source("no_such_kernel.metal")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy so the repo gets no build/ or egg-info litter (and no stale files end up in the wheel).
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"wheel build failed (needs setuptools>=77: pip install -e .[dev]):\n{proc.stderr}"
    (built,) = out.glob("dflash_mlx-*.whl")
    return built


def test_wheel_contains_subpackages_and_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"dflash_mlx/convert/{p.name}" for p in (REPO / "convert").glob("*.py")}
    expected |= {f"dflash_mlx/metal/{p.name}" for p in (REPO / "metal").iterdir() if p.suffix in (".py", ".metal", ".h")}
    # Every module and data file of the package itself, subpackages included.
    expected |= {f"dflash_mlx/{p.relative_to(REPO / 'dflash_mlx').as_posix()}"
                 for p in (REPO / "dflash_mlx").rglob("*") if p.suffix in (".py", ".json")}
    # Shipped drafters: weights, config and model card.
    expected |= {f"dflash_mlx/{p.relative_to(REPO / 'dflash_mlx').as_posix()}"
                 for p in (REPO / "dflash_mlx" / "drafters").glob("*/*") if p.parent.name != "__pycache__"}
    # The chat page served at GET /, vendored libraries and their licenses included.
    expected |= {f"dflash_mlx/{p.relative_to(REPO / 'dflash_mlx').as_posix()}"
                 for p in (REPO / "dflash_mlx" / "server" / "static").rglob("*") if p.is_file()}
    assert "dflash_mlx/server/static/vendor/marked.LICENSE.md" in expected
    assert "dflash_mlx/metal/dflash_common.h" in expected
    assert expected <= names, f"missing from wheel: {sorted(expected - names)}"
    assert not any(n.startswith(("convert/", "metal/")) for n in names), "top-level convert/ or metal/ leaked"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "dflash-mlx = dflash_mlx.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_resolves_inside_its_target(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import json, dflash_mlx, dflash_mlx.convert, dflash_mlx.metal as m\n"
        "from importlib import resources\n"
        "print(json.dumps({'files': [dflash_mlx.__file__, dflash_mlx.convert.__file__, m.__file__,\n"
        "  str(resources.files('dflash_mlx.metal') / 'dflash_common.h')],\n"
        "  'header': m.read_source('dflash_common.h')}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    for path in result["files"]:
        assert _inside(path, target), f"{path} resolved outside the installed wheel"
    assert "DFLASH_COMMON_H" in result["header"]


def test_demo_pair_loads(tmp_path, capsys):
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    from dflash_mlx.drafters.config import DFlashConfig
    from dflash_mlx.demo import main
    from dflash_mlx.drafters.dflash import DFlashDrafter

    assert main([str(tmp_path)]) == 0
    target_dir, drafter_dir = (Path(line) for line in capsys.readouterr().out.split())
    model, tokenizer = mlx_lm.load(str(target_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert len(prompt) > 3 and tokenizer.eos_token_ids

    config = DFlashConfig.from_dict(json.loads((drafter_dir / "config.json").read_text()))
    target_config = json.loads((target_dir / "config.json").read_text())
    assert config.hidden_size == target_config["hidden_size"]
    assert config.vocab_size == target_config["vocab_size"] == len(tokenizer.vocab)
    assert all(0 <= i < target_config["num_hidden_layers"] for i in config.target_layer_ids)
    assert config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")

    weights = mx.load(str(drafter_dir / "model.safetensors"))
    expected = dict(tree_flatten(DFlashDrafter(config).parameters()))
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in expected.items()}
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), config.vocab_size) and logits.dtype == mx.float32
