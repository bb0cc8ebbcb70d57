"""Registry names resolve to the right repos without any network; unknown names suggest close ones; hub drafters
convert once into a cache keyed by revision."""

import json
import logging
from pathlib import Path

import pytest

from dflash_mlx import api
from dflash_mlx.models import hub, loading, registry
from dflash_mlx.errors import DFlashError

EXPECTED_DRAFTERS = {
    "Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash", "Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash", "Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen3.5-122B-A10B": "z-lab/Qwen3.5-122B-A10B-DFlash", "Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash", "Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16", "Qwen3-Coder-30B-A3B": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "Qwen3-Coder-Next": "z-lab/Qwen3-Coder-Next-DFlash", "gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash", "gemma-4-26B-A4B-it": "z-lab/gemma-4-26B-A4B-it-DFlash",
    "gemma-4-31B-it": "z-lab/gemma-4-31B-it-DFlash", "Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
    "MiniMax-M2.5": "z-lab/MiniMax-M2.5-DFlash",
    # DFlash 2 drafters (z-lab / Inco AI).
    "Qwen3.8-27B": "incoai/Qwen3.8-27B-DFlash2", "Muse-Glimmer-30B": "z-lab/Muse-Glimmer-30B-DFlash2",
    # DSpark drafters (DeepSeek DeepSpec) for the same MLX targets.
    "Qwen3-4B-DSpark": "deepseek-ai/dspark_qwen3_4b_block7", "Qwen3-8B-DSpark": "deepseek-ai/dspark_qwen3_8b_block7",
    "Qwen3-14B-DSpark": "deepseek-ai/dspark_qwen3_14b_block7",
    # EAGLE-3 drafters (speculators and SpecForge layouts) for the same MLX targets.
    "Qwen3-4B-EAGLE3": "AngelSlim/Qwen3-4B_eagle3", "Qwen3-8B-EAGLE3": "RedHatAI/Qwen3-8B-speculator.eagle3",
    "gpt-oss-20b-EAGLE3": "RedHatAI/gpt-oss-20b-speculator.eagle3",
    # No drafter published: the target's own MTP layers draft.
    "Qwen3.5-0.8B": "mtp", "Qwen3.5-2B": "mtp",
}


def test_every_published_pair_is_registered():
    assert set(registry.names()) == set(EXPECTED_DRAFTERS)


@pytest.mark.parametrize("name", sorted(EXPECTED_DRAFTERS))
def test_each_name_resolves_to_mlx_target_and_zlab_drafter(name):
    entry = registry.find(name)
    resolved = registry.resolve(name)
    assert resolved.drafter == EXPECTED_DRAFTERS[name]
    assert resolved.quant == entry.default_quant
    assert resolved.target == entry.targets[entry.default_quant]
    for quant, repo in entry.targets.items():
        assert registry.resolve(name, quant).target == repo
        assert repo.count("/") == 1 and name.split("-")[0].lower() in repo.lower()


def test_quant_and_case():
    assert registry.resolve("qwen3.5-9b", "bf16").target == "mlx-community/Qwen3.5-9B-bf16"
    assert registry.resolve("Qwen3.5-9B", "4bit").target == "mlx-community/Qwen3.5-9B-4bit"
    with pytest.raises(DFlashError, match="--quant"):
        registry.resolve("Qwen3.5-9B", "3bit")


@pytest.mark.parametrize("typo, expected", [("Qwen3.5-8B", "Qwen3.5-9B"), ("gpt-oss-21b", "gpt-oss-20b"),
                                            ("gemma-4-31b", "gemma-4-31B-it")])
def test_unknown_names_suggest_close_ones(typo, expected):
    with pytest.raises(DFlashError) as e:
        registry.resolve(typo)
    assert expected in str(e.value) and "did you mean" in str(e.value)


def test_offline_names_are_suggested_too():
    with pytest.raises(DFlashError, match="smollm2-135m"):
        loading.resolve_name("smollm2-13m", None, None)


def _fake_snapshot(tmp_path: Path, pair_drafter: Path, commit: str) -> Path:
    """A hub snapshot folder (named by commit, as huggingface_hub lays them out) holding a raw z-lab drafter."""
    snap = tmp_path / "hub" / commit
    snap.mkdir(parents=True)
    for f in pair_drafter.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return snap


def test_hub_drafter_converts_once_per_revision_and_works_offline(tmp_path, monkeypatch):
    from dflash_mlx.demo import make_tiny_pair

    _, drafter_dir = make_tiny_pair(tmp_path / "pair")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    snapshots = {"abc123": _fake_snapshot(tmp_path, drafter_dir, "abc123")}
    calls = []

    def snapshot(repo, revision):
        calls.append((repo, revision))
        if not snapshots:
            raise ConnectionError("offline")
        return next(iter(snapshots.values()))

    monkeypatch.setattr(hub, "_snapshot", snapshot)
    first = hub.cached_drafter("z-lab/Tiny-DFlash")
    assert first == tmp_path / "home" / "drafters" / "z-lab--Tiny-DFlash" / "abc123"
    assert json.loads((first / "config.json").read_text())["model_type"] == "dflash"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert hub.cached_drafter("z-lab/Tiny-DFlash") == first  # reused, not converted again
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    snapshots.clear()  # offline: the cached conversion still serves
    assert hub.cached_drafter("z-lab/Tiny-DFlash") == first
    with pytest.raises(DFlashError, match="no converted copy is cached"):
        hub.cached_drafter("z-lab/Other-DFlash")


def test_collapse_warning_fires_once_on_a_random_drafter(tmp_path, caplog):
    from dflash_mlx.demo import make_tiny_pair

    target_dir, drafter_dir = make_tiny_pair(tmp_path)
    model, tokenizer, drafter = api.load(str(target_dir), str(drafter_dir))
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        # Lookup off: this is about the drafter's own acceptance (the tiny model repeats itself, so copies succeed).
        responses = list(api.stream_generate(model, tokenizer, "hello", drafter, max_tokens=120, lookup=False))
    assert responses[-1].tau < 1.25
    warnings = [r for r in caplog.records if "acceptance collapsed" in r.getMessage()]
    assert len(warnings) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        list(api.stream_generate(model, tokenizer, "hello", drafter, max_tokens=120, warn_collapse=False))
    assert not caplog.records
