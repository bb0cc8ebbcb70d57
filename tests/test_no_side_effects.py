"""The user's objects stay theirs: preparing a target and running DFlash on it writes nothing on the model (no
attribute, no swapped layer class, even where the verify kernel is on), `check_pair` only checks, and the core
modules import nothing from `dflash_mlx.distributed` (which builds its pipeline targets itself)."""

from __future__ import annotations

import ast
import dataclasses
import gc
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import dflash_mlx
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.loading import prepare
from dflash_mlx.metal import verify_qmm as vq
from dflash_mlx.models.pairing import check_pair
from dflash_mlx.targets import TargetModel
from tiny import build_target, greedy, make_drafter, prompt_ids

PROMPT = prompt_ids(7, seed=3)
MAX_TOKENS = 14


def _fresh(quantized: bool) -> nn.Module:
    model = build_target("qwen3", seed=5)  # untied: its LM head is a linear too
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    return model


def _snapshot(model: nn.Module) -> dict:
    """Every module: its object, class and attribute names."""
    return {name: (id(m), type(m), sorted(m.__dict__)) for name, m in model.named_modules()}


def _dflash(model: nn.Module, drafter) -> list:
    target = prepare(model, drafter)
    ids = mx.array(PROMPT, dtype=mx.int32)
    return [t for c in dflash_generate_step(ids, target, drafter, max_tokens=MAX_TOKENS) for t in c.tokens]


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4bit"])
def test_prepare_and_generation_leave_the_model_as_it_was(quantized):
    model = _fresh(quantized)
    drafter, _ = make_drafter(model, block_size=4)
    before, plain = _snapshot(model), greedy(model, PROMPT, MAX_TOKENS)
    ours = _dflash(model, drafter)
    prepare(model, drafter, probe=True)
    prepare(model, None)
    assert _snapshot(model) == before
    assert greedy(model, PROMPT, MAX_TOKENS) == plain
    if not quantized:  # lossless in fp32 (quantized verify rows may round apart at a near-tie: test_quantized.py)
        assert ours == plain


def test_prepare_binds_once_and_keeps_a_held_target_taps():
    model = _fresh(False)
    drafter, _ = make_drafter(model, block_size=4, target_layer_ids=[1, 3])
    target = prepare(model, drafter)
    binding = drafter.binding
    assert prepare(model, drafter) is target and drafter.binding is binding  # not rebound
    mine = TargetModel(model, [0])
    theirs = prepare(mine, drafter)
    assert mine.tap_layer_ids == [0] and theirs.tap_layer_ids == [1, 3] and type(theirs) is TargetModel


def test_the_target_table_keeps_no_model_alive():
    model = _fresh(False)
    drafter, own = make_drafter(model, block_size=4)
    prepare(model, drafter)
    prepare(model, None)
    gone = weakref.ref(model)
    del model, drafter, own
    gc.collect()
    assert gone() is None


def test_check_pair_only_checks():
    model = _fresh(False)
    drafter, _ = make_drafter(model, block_size=4, target_layer_ids=[1, 3])
    target = TargetModel(model, [0])
    check_pair(target, drafter.config)
    assert target.tap_layer_ids == [0]
    bad = dataclasses.replace(drafter.config, target_layer_ids=[1, 9])
    with pytest.raises(DFlashError, match="valid ids 0..3"):
        check_pair(target, bad)
    assert target.tap_layer_ids == [0]


def test_verify_kernel_is_scoped_to_our_passes(monkeypatch):
    """Where kernels are on (patched here; the kernel is mlx's own matmul), our verify passes take the kernel and
    the user's quantized layers are mlx's own class before, after, and for mlx-lm's calls in between."""
    model = _fresh(True)
    drafter, _ = make_drafter(model, block_size=4)
    before, plain = _snapshot(model), greedy(model, PROMPT, MAX_TOKENS)
    calls = []
    monkeypatch.setattr(vq, "kernels_on", lambda: True)
    monkeypatch.setattr(vq, "verify_qmm_metal", lambda *a, **k: calls.append(1) or vq.verify_qmm_reference(*a, **k))
    ours = _dflash(model, drafter)
    assert calls, "no verify pass took the kernel"
    assert _snapshot(model) == before
    assert all(type(m) is nn.QuantizedLinear for m in model.modules() if isinstance(m, nn.QuantizedLinear))
    seen = len(calls)
    assert greedy(model, PROMPT, MAX_TOKENS) == plain  # mlx-lm's decode: one row, the stock path
    model(mx.array([PROMPT[:5]], dtype=mx.int32))  # a 5-row call of the model's own: not ours, no kernel
    assert len(calls) == seen
    assert len(ours) == MAX_TOKENS


def test_pipeline_targets_come_from_the_distributed_side(monkeypatch):
    from dflash_mlx.distributed.pipeline import PipelineTarget, make_target
    from dflash_mlx.targets import adapter

    model = _fresh(False)
    assert type(make_target(model)) is TargetModel
    model.model.pipeline_size = 2  # what mlx-lm's `pipeline()` leaves on a model split into stages (a test copy)
    assert type(make_target(model)) is PipelineTarget
    assert type(prepare(model, None)) is PipelineTarget  # the class distributed installs on import
    monkeypatch.setattr(adapter, "_classes", [])  # nothing installed: the core alone refuses to walk one stage
    with pytest.raises(DFlashError, match="make_target"):
        prepare(model, None)(mx.array([PROMPT], dtype=mx.int32))


CORE = ["drafters/config.py", "drafters/dflash.py", "models/loading.py", "models/pairing.py"] + sorted(
    p.relative_to(Path(dflash_mlx.__file__).parent).as_posix()
    for folder in ("decode", "decode/proposers", "targets") for p in (Path(dflash_mlx.__file__).parent / folder).glob("*.py")
    if "\nfrom " in p.read_text() or "\nimport " in p.read_text())  # a docstring-only marker has nothing to check


def _imports(path: Path, package: str) -> set:
    """Absolute names of every module `path` imports (at any depth: function-level imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("name", CORE)
def test_core_imports_nothing_from_distributed(name):
    root = Path(dflash_mlx.__file__).parent
    package = "dflash_mlx" + ("." + str(Path(name).parent).replace("/", ".") if "/" in name else "")
    imported = _imports(root / name, package)
    assert imported, f"{name}: no imports parsed"
    assert not [m for m in imported if m.startswith("dflash_mlx.distributed")], f"{name} imports the distributed side"
