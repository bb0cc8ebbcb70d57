"""The tapped target: features are decoder-layer outputs (HF hidden_states[k+1]), logits are the model's own,
rollback is exact, and unsupported targets or taps fail with one clear DFlashError."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.utils import _get_classes

from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import TargetModel, supported_model_types
from tiny import ALL_KINDS, HIDDEN, TARGET_CONFIGS, VOCAB, build_target, prompt_ids, randomize, target

TOL = 1e-4
FULL_ONLY = [k for k in ALL_KINDS if "layer_types" not in TARGET_CONFIGS[k]]


def _ids(n, seed=0):
    return mx.array([prompt_ids(n, seed)], dtype=mx.int32)


def _manual_layer_outputs(model, ids, window=None):
    """Walk mlx-lm's own layers with explicitly built masks: output of every decoder layer, no cache."""
    inner = model.model
    h = inner.embed_tokens(ids)
    T = ids.shape[1]
    outs = []
    for layer in inner.layers:
        sliding = getattr(layer, "use_sliding", False)
        mask = create_causal_mask(T, 0, window_size=window if sliding else None)
        h = layer(h, mask, None)
        outs.append(h)
    return outs


def _truncated_output(kind, model, k, ids):
    """Output of decoder layer k from a copy of the model cut after layer k, final norm removed."""
    config = dict(TARGET_CONFIGS[kind], num_hidden_layers=k + 1)
    model_class, args_class = _get_classes(config)
    cut = model_class(args_class.from_dict(config))
    weights = [(n, p) for n, p in tree_flatten(model.parameters())
               if not (n.startswith("model.layers.") and int(n.split(".")[2]) > k)]
    cut.load_weights(weights, strict=False)
    cut.model.norm = nn.Identity()
    return cut.model(ids)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_taps_are_decoder_layer_outputs(kind):
    model = target(kind)
    L = len(model.layers)
    ids = _ids(12)  # longer than llama_swa's window of 8
    t = TargetModel(model, list(range(L)))
    logits, hidden = t(ids)
    assert hidden.shape == (1, 12, L * HIDDEN)
    manual = _manual_layer_outputs(model, ids, TARGET_CONFIGS[kind].get("sliding_window"))
    for k in range(L):
        np.testing.assert_allclose(np.array(hidden[..., k * HIDDEN:(k + 1) * HIDDEN]), np.array(manual[k]), atol=TOL)
    np.testing.assert_allclose(np.array(logits), np.array(model(ids)), atol=TOL)
    # Id k is not the embedding output (HF hidden_states[0]) nor layer k-1's output.
    assert np.abs(np.array(hidden[..., :HIDDEN]) - np.array(model.model.embed_tokens(ids))).max() > 1e-2


@pytest.mark.parametrize("kind", FULL_ONLY)
def test_taps_equal_truncated_model(kind):
    model = target(kind)
    ids = _ids(9, seed=1)
    L = len(model.layers)
    for k in range(L):
        _, hidden = TargetModel(model, [k])(ids)
        np.testing.assert_allclose(np.array(hidden), np.array(_truncated_output(kind, model, k, ids)), atol=TOL)


def test_taps_keep_listed_order():
    model = target("qwen3")
    ids = _ids(6)
    _, both = TargetModel(model, [2, 0])(ids)
    _, two = TargetModel(model, [2])(ids)
    _, zero = TargetModel(model, [0])(ids)
    np.testing.assert_array_equal(np.array(both), np.concatenate([np.array(two), np.array(zero)], axis=-1))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_cached_taps_equal_full_forward(kind):
    model = target(kind)
    t = TargetModel(model, [0, len(model.layers) - 1])
    ids = _ids(14, seed=2)
    full_logits, full_hidden = t(ids)
    cache = t.make_cache()
    parts = [t(ids[:, :10], cache), t(ids[:, 10:11], cache), t(ids[:, 11:], cache)]
    logits = mx.concatenate([p[0] for p in parts], axis=1)
    hidden = mx.concatenate([p[1] for p in parts], axis=1)
    np.testing.assert_allclose(np.array(hidden), np.array(full_hidden), atol=TOL)
    np.testing.assert_allclose(np.array(logits), np.array(full_logits), atol=TOL)


def _rollback_case(kind, prefill):
    """Prefill, verify 4 tokens, roll 3 back, decode 1: must equal the full forward."""
    model = target(kind)
    t = TargetModel(model, [1])
    ids = _ids(prefill + 2, seed=3)
    junk = mx.array([[5, 6, 7]], dtype=mx.int32)
    cache = t.make_cache()
    t(ids[:, :prefill], cache)
    t(mx.concatenate([ids[:, prefill:prefill + 1], junk], axis=1), cache)
    t.rollback(cache, 3)
    assert all(c.offset == prefill + 1 for c in cache)
    logits, hidden = t(ids[:, prefill + 1:], cache)
    full_logits, full_hidden = t(ids)
    np.testing.assert_allclose(np.array(hidden[0, -1]), np.array(full_hidden[0, -1]), atol=TOL)
    np.testing.assert_allclose(np.array(logits[0, -1]), np.array(full_logits[0, -1]), atol=TOL)


@pytest.mark.parametrize("kind", FULL_ONLY)
def test_rollback_is_exact(kind):
    _rollback_case(kind, prefill=10)


@pytest.mark.parametrize("prefill", [3, 10])  # 3 + 4 fits the 8-token window; 10 wraps it
def test_sliding_window_rollback(prefill):
    _rollback_case("llama_swa", prefill)


def test_sliding_window_rollback_repeatedly():
    # Many verify/rollback rounds past the window, ending in 1-token steps (the engine's clamped last block).
    model = target("llama_swa")
    t = TargetModel(model, [1])
    seq = prompt_ids(40, seed=4)
    cache = t.make_cache()
    t(mx.array([seq[:5]]), cache)
    pos, got = 5, []
    for block, keep in [(4, 4), (4, 1), (4, 2), (4, 1), (4, 4), (2, 1), (4, 3), (4, 1), (1, 1), (2, 1), (1, 1)]:
        ids = seq[pos:pos + keep] + [3] * (block - keep)
        logits, hidden = t(mx.array([ids]), cache)
        mx.async_eval(logits, hidden)  # as the engine does: rollback happens while the device may still run
        t.rollback(cache, block - keep)
        got.append((pos, logits[0, :keep], hidden[0, :keep]))
        pos += keep
    full_logits, full_hidden = t(mx.array([seq[:pos]]))
    for p, logits, hidden in got:
        np.testing.assert_allclose(np.array(logits), np.array(full_logits[0, p:p + logits.shape[0]]), atol=TOL)
        np.testing.assert_allclose(np.array(hidden), np.array(full_hidden[0, p:p + hidden.shape[0]]), atol=TOL)


def test_raw_rotating_cache_is_refused():
    # mlx-lm's own RotatingKVCache cannot drop tokens once its window is full: insist on TargetModel.make_cache.
    from mlx_lm.models.cache import make_prompt_cache

    t = TargetModel(target("llama_swa"), [1])
    with pytest.raises(DFlashError, match="RotatingKVCache"):
        t.check_rollback_supported(make_prompt_cache(t.model))
    t.check_rollback_supported(t.make_cache())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_probe_parity(kind):
    assert TargetModel(target(kind), [0]).probe_parity() < 1e-4


def test_head_and_embed_are_the_targets():
    for kind in ("qwen3", "llama"):  # untied, tied
        model = target(kind)
        t = TargetModel(model, [0])
        ids = _ids(5)
        np.testing.assert_array_equal(np.array(t.embed(ids)), np.array(model.model.embed_tokens(ids)))
        h = model.model(ids)
        np.testing.assert_allclose(np.array(t.head(h)), np.array(model(ids)), atol=1e-6)
        assert t.vocab_size == VOCAB and t.hidden_size == HIDDEN


@pytest.mark.parametrize("config", [
    dict(model_type="phi3", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
         rms_norm_eps=1e-6, vocab_size=VOCAB),
    dict(model_type="gpt2", n_ctx=64, n_embd=64, n_head=4, n_layer=2, n_positions=64, layer_norm_epsilon=1e-5,
         vocab_size=VOCAB),
])
def test_unsupported_architecture(config):
    model_class, args_class = _get_classes(config)
    model = randomize(model_class(args_class.from_dict(config)), 0)
    with pytest.raises(DFlashError) as err:
        TargetModel(model, [0])
    message = str(err.value)
    assert config["model_type"] in message
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert name in message
    assert set(supported_model_types()) >= {"llama", "mistral", "qwen2", "qwen3"}


@pytest.mark.parametrize("taps", [[4], [0, 4], [-1], [1, 7]])
def test_tap_ids_out_of_range(taps):
    model = target("llama")  # 4 layers: ids 0..3
    with pytest.raises(DFlashError, match="4 layers"):
        TargetModel(model, taps)


def test_rollback_check_rejects_untrimmable_cache():
    model = build_target("qwen3", num_hidden_layers=2)
    t = TargetModel(model, [0])

    class Stuck:
        def is_trimmable(self):
            return False

    with pytest.raises(DFlashError, match="Stuck"):
        t.check_rollback_supported([Stuck()])
