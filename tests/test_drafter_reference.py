"""The drafter forward against a plain NumPy (float64) transcription of docs/algorithm.md, "The drafter".

The reference below reads the drafter's weights by their checkpoint names and the target's embedding and head,
and recomputes everything else from the spec: fusion, block embedding, pre-norm Qwen3 layers with q/k norms,
neox RoPE at absolute positions, unmasked GQA attention over context + block, final norm, head on slots 1..B-1.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tiny import VOCAB, make_drafter, target

TOL = 1e-4


# -- the reference ---------------------------------------------------------------------------------------------
def _np(params) -> dict:
    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(params)}


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, base):
    # x: [T, heads, D]; rotate-half (neox) pairs (i, i + D/2).
    D = x.shape[-1]
    half = D // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / D)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference_logits(P, cfg, embed, head, features, block_ids):
    """Draft logits [B-1, V] for a block right after `features` (all context, positions 0..S-1)."""
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    nH, nKV = cfg.num_attention_heads, cfg.num_key_value_heads
    S, B = features.shape[0], len(block_ids)
    ctx = _rms(features @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    x = embed[np.asarray(block_ids)]
    if cfg.input_embedding_scale is not None:
        x = x * cfg.input_embedding_scale
    ctx_pos, blk_pos = np.arange(S), S + np.arange(B)
    for i, layer_type in enumerate(cfg.layer_types):
        p = lambda name: P[f"layers.{i}.{name}"]  # noqa: E731
        a = _rms(x, p("input_layernorm.weight"), eps)

        def kv(src, pos):
            k = (src @ p("self_attn.k_proj.weight").T).reshape(len(src), nKV, hd)
            k = _rms(k, p("self_attn.k_norm.weight"), eps)
            v = (src @ p("self_attn.v_proj.weight").T).reshape(len(src), nKV, hd)
            return _rope(k, pos, cfg.rope_theta), v

        q = _rms((a @ p("self_attn.q_proj.weight").T).reshape(B, nH, hd), p("self_attn.q_norm.weight"), eps)
        q = _rope(q, blk_pos, cfg.rope_theta)
        kc, vc = kv(ctx, ctx_pos)
        kb, vb = kv(a, blk_pos)
        sliding = layer_type == "sliding_attention"
        K, V = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        allowed = np.ones((B, S + B), dtype=bool)
        if sliding:
            # A sliding window over absolute positions for the context: the query at S+i sees context keys
            # above S+i-W (the block's own keys are not windowed, as in the reference).
            allowed[:, :S] &= ctx_pos[None, :] > (blk_pos[:, None] - cfg.sliding_window)
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        if causal:
            allowed[:, S:] &= np.tril(np.ones((B, B), dtype=bool))
        out = np.zeros((B, nH, hd))
        for h in range(nH):
            g = h // (nH // nKV)  # GQA: consecutive query heads share a KV head
            scores = q[:, h] @ K[:, g].T * hd ** -0.5
            scores = np.where(allowed, scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, h] = w @ V[:, g]
        h_ = x + out.reshape(B, nH * hd) @ p("self_attn.o_proj.weight").T
        m = _rms(h_, p("post_attention_layernorm.weight"), eps)
        mlp = (_silu(m @ p("mlp.gate_proj.weight").T) * (m @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        x = h_ + mlp
    logits = _rms(x, P["norm.weight"], eps)[1:] @ head.T
    if cfg.output_multiplier is not None:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def _embed_and_head(model):
    W = _np(model.parameters())
    embed = W["model.embed_tokens.weight"]
    return embed, W.get("lm_head.weight", embed)


# -- helpers ---------------------------------------------------------------------------------------------------
def _setup(kind="qwen3", block_size=5, **config):
    model = target(kind)
    drafter, _ = make_drafter(model, block_size=block_size, **config)
    embed, head = _embed_and_head(model)
    return drafter, embed, head


def _features(drafter, S, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((S, drafter.config.num_taps * drafter.config.hidden_size)).astype(np.float32)


def _block(drafter, B, first=7):
    return [first] + [drafter.config.mask_token_id] * (B - 1)


def _run(drafter, chunks, block_ids):
    cache = drafter.make_cache()
    for chunk in chunks:
        drafter.append_context(mx.array(chunk)[None], cache)
    out = drafter(mx.array([block_ids], dtype=mx.int32), cache)
    return np.array(out[0], dtype=np.float64), cache


def _check(drafter, embed, head, feats, block_ids, chunks=None):
    ours, cache = _run(drafter, chunks or [feats], block_ids)
    ref = reference_logits(_np(drafter.parameters()), drafter.config, embed, head, feats.astype(np.float64), block_ids)
    assert ours.shape == (len(block_ids) - 1, VOCAB)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=TOL)
    return ours, cache


# -- tests -----------------------------------------------------------------------------------------------------
def test_weight_names_follow_the_checkpoint_format():
    drafter, _, _ = _setup(num_hidden_layers=2)
    names = {k for k, _ in tree_flatten(drafter.parameters())}
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == expected  # no embedding, no LM head: those are the target's


@pytest.mark.parametrize(
    "kind, heads, kv_heads, head_dim",
    [
        ("qwen3", 4, 4, 16),  # untied target head, MHA
        ("qwen3", 4, 2, 16),  # GQA 2
        ("llama", 8, 2, 16),  # tied head, GQA 4, q width 128 != hidden 64
        ("qwen2", 4, 1, 24),  # tied, MQA, head_dim not hidden/heads
    ],
)
def test_forward_matches_reference(kind, heads, kv_heads, head_dim):
    drafter, embed, head = _setup(kind, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    feats = _features(drafter, 7)
    _check(drafter, embed, head, feats, _block(drafter, 5))


@pytest.mark.parametrize("B", [2, 16])
def test_block_sizes(B):
    drafter, embed, head = _setup(block_size=B, num_hidden_layers=3)
    _check(drafter, embed, head, _features(drafter, 3, seed=B), _block(drafter, B, first=11))


def test_draft_rope_theta_is_the_drafters_own():
    drafter, embed, head = _setup("llama", rope_theta=500_000.0)  # target uses 10_000
    _check(drafter, embed, head, _features(drafter, 9), _block(drafter, 5))


def test_context_appended_in_two_calls_equals_one():
    drafter, embed, head = _setup()
    feats = _features(drafter, 10, seed=3)
    block = _block(drafter, 5)
    one, cache1 = _check(drafter, embed, head, feats, block)
    two, cache2 = _check(drafter, embed, head, feats, block, chunks=[feats[:4], feats[4:]])
    np.testing.assert_allclose(one, two, atol=1e-5)
    assert [c.offset for c in cache1] == [c.offset for c in cache2] == [10, 10]


def test_draft_step_leaves_context_cache_unchanged():
    drafter, embed, head = _setup()
    feats = _features(drafter, 6)
    first, cache = _check(drafter, embed, head, feats, _block(drafter, 5))
    assert [c.offset for c in cache] == [6, 6]
    again = np.array(drafter(mx.array([_block(drafter, 5)], dtype=mx.int32), cache)[0])
    np.testing.assert_allclose(again, first, atol=1e-6)
    # The next step's block sits right after the newly appended context.
    more = _features(drafter, 3, seed=9)
    drafter.append_context(mx.array(more)[None], cache)
    nxt = np.array(drafter(mx.array([_block(drafter, 5, first=3)], dtype=mx.int32), cache)[0], dtype=np.float64)
    ref = reference_logits(_np(drafter.parameters()), drafter.config, embed, head,
                           np.concatenate([feats, more]).astype(np.float64), _block(drafter, 5, first=3))
    np.testing.assert_allclose(nxt, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("is_causal", [None, False, True])
@pytest.mark.parametrize("S", [2, 9])
def test_sliding_attention_layer(is_causal, S):
    # window 4 over absolute positions (slot i sees 3 - i context keys once the context is long enough);
    # causal inside the block unless is_causal is false.
    drafter, embed, head = _setup(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                  is_causal=is_causal)
    feats = _features(drafter, S, seed=S)
    _check(drafter, embed, head, feats, _block(drafter, 5), chunks=[feats[: S // 2], feats[S // 2:]])


def test_is_causal_applies_to_full_attention_layers_too():
    drafter, embed, head = _setup(is_causal=True)
    feats = _features(drafter, 6)
    causal, _ = _check(drafter, embed, head, feats, _block(drafter, 5))
    drafter.config.is_causal = None
    for layer in drafter.layers:
        layer.self_attn.block_causal = False
    bidirectional, _ = _check(drafter, embed, head, feats, _block(drafter, 5))
    assert np.abs(causal - bidirectional).max() > 1e-3


def test_sliding_layer_really_differs_from_full():
    # Guards the test above against a reference that ignores the window.
    drafter, embed, head = _setup(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    feats = _features(drafter, 9)
    P = _np(drafter.parameters())
    sliding = reference_logits(P, drafter.config, embed, head, feats.astype(np.float64), _block(drafter, 5))
    drafter.config.layer_types = ["full_attention"] * 2
    full = reference_logits(P, drafter.config, embed, head, feats.astype(np.float64), _block(drafter, 5))
    assert np.abs(sliding - full).max() > 1e-2


def test_gemma_knobs():
    drafter, embed, head = _setup(input_embedding_scale=8.0, output_multiplier=3.0, final_logit_softcapping=2.5)
    ours, _ = _check(drafter, embed, head, _features(drafter, 5), _block(drafter, 5))
    assert np.abs(ours).max() < 2.5 and np.abs(ours).max() > 1.5  # the cap is active


def test_each_knob_matters():
    drafter, embed, head = _setup()
    feats, block = _features(drafter, 5), _block(drafter, 5)
    base, _ = _run(drafter, [feats], block)
    for knob, value in [("input_embedding_scale", 8.0), ("output_multiplier", 3.0), ("final_logit_softcapping", 1.0)]:
        setattr(drafter.config, knob, value)
        ours, _ = _check(drafter, embed, head, feats, block)
        assert np.abs(ours - base).max() > 1e-2, knob
        setattr(drafter.config, knob, None)
