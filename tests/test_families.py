"""Every target family end to end: the parity probe, lossless greedy DFlash (== mlx-lm's own greedy decoding) with
partial accepts of every length, the oracle's full acceptance, and Gemma's embedding scale and logit soft-cap."""

from __future__ import annotations

import functools
from typing import List, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from cache_compare import ALL, CONFIGS, HYBRID, VOCAB, WINDOW, build, prompt, randomize, shared
from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.drafters.dflash import DFlashDrafter, TargetBinding
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel

MAX_TOKENS = 24
# The nested layouts (gemma3, gemma4) run the same layers as their text models; probe and rollback tests cover them.
LOSSLESS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text", "qwen3_moe", "deepseek_v3",
            "gemma4_text")
PROMPTS = (5, 3 * WINDOW - 1)  # shorter and longer than the sliding window


@functools.lru_cache(maxsize=None)
def greedy(kind: str, length: int) -> List[int]:
    """mlx-lm's own greedy decoding, on mlx-lm's own caches."""
    ids = mx.array(prompt(length, seed=length), dtype=mx.int32)
    return [int(t) for t, _ in generate_step(ids, shared(kind), max_tokens=MAX_TOKENS)]


class SpoiledOracle(OracleDrafter):
    """Proposes the reference continuation but spoils every position p with p % every == 0: accepts of all lengths."""

    def __init__(self, sequence: Sequence[int], block_size: int, every: int):
        super().__init__(sequence, VOCAB, block_size, VOCAB - 1)
        self.every = every

    def __call__(self, block_ids, cache):
        start, block = cache[0].offset, block_ids.shape[1]
        proposals = []
        for p in range(start + 1, start + block):
            tok = self.sequence[p] if p < len(self.sequence) else 0
            proposals.append((tok + 1) % VOCAB if p % self.every == 0 else tok)
        hot = mx.array(proposals, dtype=mx.int32)[:, None] == mx.arange(VOCAB)[None]
        return mx.where(hot, 30.0, -30.0)[None]


def run(t: TargetModel, ids: Sequence[int], drafter, block_size: int):
    tokens, accepted = [], []
    for cycle in dflash_generate_step(mx.array(list(ids), dtype=mx.int32), t, drafter, max_tokens=MAX_TOKENS,
                                      width=block_size):
        tokens += cycle.tokens
        if not cycle.is_prefill:
            accepted.append(cycle.accepted)
    return tokens, accepted


@pytest.mark.parametrize("kind", ALL)
def test_parity_probe(kind):
    # Prefill, a verify block rolled back, and a step after it, against the model's own call on mlx-lm's caches.
    assert TargetModel(shared(kind)).probe_parity() < 1e-4


@pytest.mark.parametrize("kind", LOSSLESS)
@pytest.mark.parametrize("length", PROMPTS)
def test_lossless_with_partial_accepts(kind, length):
    ref = greedy(kind, length)
    ids = prompt(length, seed=length)
    t = TargetModel(shared(kind))
    for block_size in (2, 4, 16):
        seen = set()
        for every in (3, 5):
            out, accepted = run(t, ids, SpoiledOracle(ids + ref, block_size, every), block_size)
            assert out == ref, (block_size, every)
            seen.update(accepted)
        if block_size > 2:
            assert len(seen) > 1  # rollbacks of several lengths happened


@pytest.mark.parametrize("kind", LOSSLESS)
def test_oracle_accepts_every_block(kind):
    length = PROMPTS[1]
    ref = greedy(kind, length)
    ids = prompt(length, seed=length)
    t = TargetModel(shared(kind))
    for block_size in (2, 4, 16):
        out, accepted = run(t, ids, OracleDrafter(ids + ref, VOCAB, block_size, VOCAB - 1), block_size)
        assert out == ref
        # tau == B: every cycle but a final one clamped by max_tokens accepts its whole block
        assert all(a == block_size - 1 for a in accepted[:-1]), accepted
        assert np.mean([a + 1 for a in accepted[:-1]] or [block_size]) == block_size


def _drafter(t: TargetModel, block_size: int, **config) -> DFlashDrafter:
    n = t.num_layers
    cfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, vocab_size=VOCAB, head_dim=16, rope_theta=10000.0,
                       block_size=block_size, target_layer_ids=sorted({0, n - 2}), mask_token_id=VOCAB - 1, **config)
    drafter = randomize(DFlashDrafter(cfg), seed=1)
    t.set_taps(cfg.target_layer_ids)
    return drafter.bind(TargetBinding(t.embed, t.head))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "gpt_oss", "gemma3", "gemma4_text", "deepseek_v3"])
def test_lossless_with_real_drafter(kind):
    # A random DFlash drafter on the tapped features: mostly rejected blocks, i.e. rollbacks of B - 1 tokens.
    length = PROMPTS[1]
    t = TargetModel(shared(kind))
    out, _ = run(t, prompt(length, seed=length), _drafter(t, 4), 4)
    assert out == greedy(kind, length)


def test_gemma_embedding_is_scaled_for_the_drafter():
    ids = mx.array([[1, 5, 9]], dtype=mx.int32)
    for kind in ("gemma3_text", "gemma3"):
        t = TargetModel(shared(kind))
        raw = t.inner.embed_tokens(ids)
        scale = float(mx.array(t.hidden_size**0.5, mx.bfloat16).astype(mx.float32).item())
        assert mx.array_equal(t.embed(ids), raw * scale).item()
    t = TargetModel(shared("gemma4_text"))
    assert mx.allclose(t.embed(ids), t.inner.embed_tokens(ids) * t.hidden_size**0.5).item()


def test_gemma_drafter_embedding_is_target_scale_times_input_scale():
    t = TargetModel(shared("gemma3_text"))
    block = mx.array([[3] + [VOCAB - 1] * 3], dtype=mx.int32)
    scaled = t.inner.embed_tokens(block) * mx.array(t.hidden_size**0.5, mx.bfloat16).astype(mx.float32)
    outputs = []
    for scale, embed in ((0.5, t.embed), (None, lambda ids: t.embed(ids) * 0.5)):
        drafter = _drafter(t, 4, input_embedding_scale=scale)
        seen = []
        drafter.bind(TargetBinding(lambda ids, embed=embed: seen.append(embed(ids)) or seen[-1], t.head))
        cache = drafter.make_cache()
        drafter.append_context(mx.ones((1, 3, drafter.config.num_taps * t.hidden_size)), cache)
        outputs.append(drafter(block, cache))
    assert mx.array_equal(t.embed(block), scaled).item()
    assert mx.array_equal(outputs[0], outputs[1]).item()


def test_gemma4_head_is_softcapped():
    t = TargetModel(shared("gemma4_text"))
    assert t.final_logit_softcapping == 30.0
    h = 50.0 * mx.random.normal((1, 3, t.hidden_size), key=mx.random.key(0))
    logits = t.head(h)
    raw = t.inner.embed_tokens.as_linear(h)
    assert mx.allclose(logits, mx.tanh(raw / 30.0) * 30.0, atol=1e-4).item()
    assert mx.abs(logits).max().item() <= 30.0
    assert mx.array_equal(t.head(h, softcap=False), raw).item()  # for drafters that apply their own cap
    assert TargetModel(shared("gemma3_text")).final_logit_softcapping is None


@pytest.mark.parametrize("variant", [
    dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),  # 26B-A4B style
    dict(attention_k_eq_v=True, num_global_key_value_heads=1),  # 31B style
    dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0),
])
def test_gemma4_variants(variant):
    assert TargetModel(build("gemma4_text", seed=3, **variant)).probe_parity() < 1e-4


def test_nested_language_model_layouts():
    for kind in ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"):
        t = TargetModel(shared(kind))
        assert t.lm is t.model.language_model
        assert t.inner is t.model.language_model.model


@pytest.mark.parametrize("kind", HYBRID)
def test_hybrid_tied_and_untied_heads(kind):
    for tie in (False, True):
        if "text_config" in CONFIGS[kind]:
            overrides = {"text_config": dict(CONFIGS[kind]["text_config"], tie_word_embeddings=tie)}
        else:
            overrides = {"tie_word_embeddings": tie}
        t = TargetModel(build(kind, seed=2, **overrides))
        assert ("lm_head" in t.lm) != tie
        assert t.probe_parity() < 1e-4
