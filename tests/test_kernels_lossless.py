"""All kernels at once, end to end: greedy DFlash with every kernel on (the drafter's block attention, the verify
quantized matmul of a 4-bit target, the GatedDeltaNet tape and replay of a hybrid target) produces mlx-lm's own
greedy tokens, computed with the kernels off. Runs on Metal on a Mac, on the MSL emulator elsewhere."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from cache_compare import CONFIGS, build
from dflash_mlx.metal import block_attention as ba
from dflash_mlx.metal import gdn_tape as gt
from dflash_mlx.metal import verify_qmm as vq
from kernel_cases import metal_backend  # noqa: F401  (the fixture: both contractions off a Mac)
from tiny import build_target, greedy, make_drafter, prompt_ids, run_dflash

MAX_TOKENS = 12


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _plain_greedy(model, prompt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_MLX_NO_METAL", "1")
        return greedy(model, prompt, MAX_TOKENS)


def _dflash(model, prompt, drafter_layers):
    drafter, t = make_drafter(model, block_size=4, head_dim=64, sliding_window=6, layer_types=drafter_layers)
    tokens, _ = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS)
    return tokens[:MAX_TOKENS]


@pytest.mark.metal
def test_quantized_target_with_kernels_is_lossless(metal_backend, monkeypatch):
    model = build_target("qwen3").eval()
    nn.quantize(model, group_size=32, bits=4)
    prompt = prompt_ids(7, seed=11)
    expected = _plain_greedy(model, prompt)
    qmm = _counting(monkeypatch, vq, "verify_qmm_metal")
    attn = _counting(monkeypatch, ba, "block_attention_metal")
    assert _dflash(model, prompt, ["sliding_attention", "full_attention"]) == expected
    assert qmm and attn


@pytest.mark.metal
def test_hybrid_target_with_kernels_is_lossless(metal_backend, monkeypatch):
    text = dict(CONFIGS["qwen3_5"]["text_config"], linear_key_head_dim=32, linear_value_head_dim=16)
    model = build("qwen3_5", text_config=text).eval()
    prompt = prompt_ids(6, seed=12)
    expected = _plain_greedy(model, prompt)
    tape = _counting(monkeypatch, gt, "gdn_tape_metal")
    replay = _counting(monkeypatch, gt, "gdn_replay_metal")
    assert _dflash(model, prompt, ["full_attention", "full_attention"]) == expected
    assert tape and replay  # the random drafter is rejected often: rollbacks ran through the tape
