"""The drafter's fast paths change no draft: `greedy_draft` (argmax over the drafter's own vocabulary, ids mapped
after) equals the argmax of the full target-vocabulary logits, with and without a reduced vocabulary; a quantized
drafter converted to float32 at load drafts like the quantized one; and decoding through the greedy fast path
commits exactly what the full-logits path commits, chains and draft trees alike."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import VOCAB, make_drafter, prompt_ids, reference, run_dflash, target

from dflash_mlx.decode.acceptance import GreedyAcceptor
from dflash_mlx.drafters.io import load_drafter, quantize_drafter, save_drafter

DRAFT_VOCAB = 40


def _drafter(kind: str, reduced: bool, block_size: int = 8, seed: int = 1):
    extra = dict(draft_vocab_size=DRAFT_VOCAB) if reduced else {}
    drafter, t = make_drafter(target(kind), block_size=block_size, seed=seed, **extra)
    if reduced:  # draft id i is target id i + d2t[i]: a sorted random subset of the target vocabulary
        ids = np.sort(np.random.default_rng(seed).choice(VOCAB - 1, DRAFT_VOCAB, replace=False))
        drafter.d2t = mx.array(ids - np.arange(DRAFT_VOCAB), dtype=mx.int32)
    return drafter, t


def _context(drafter, t, length: int = 11, seed: int = 0):
    cache = drafter.make_cache()
    drafter.append_context(t(mx.array([prompt_ids(length, seed)]))[1], cache)
    return cache


def _blocks(drafter, sizes=(2, 4, 8)):
    mask = drafter.config.mask_token_id
    return [mx.array([[5 + B] + [mask] * (B - 1)], dtype=mx.int32) for B in sizes]


@pytest.mark.parametrize("reduced", [False, True], ids=["target-vocab", "draft-vocab"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_draft_is_the_argmax_of_the_full_logits(kind, reduced):
    drafter, t = _drafter(kind, reduced)
    cache = _context(drafter, t)
    for block_ids in _blocks(drafter):
        full = drafter(block_ids, cache)
        fast = drafter.greedy_draft(block_ids, cache)
        assert fast.dtype == mx.int32 and fast.shape == (1, block_ids.shape[1] - 1)
        assert fast.tolist() == mx.argmax(full, axis=-1).tolist()
        if reduced:  # only target ids the drafter can name
            allowed = set((np.arange(DRAFT_VOCAB) + np.array(drafter.d2t)).tolist())
            assert set(fast.reshape(-1).tolist()) <= allowed


def _top2_margin(logits: mx.array) -> float:
    top = mx.sort(logits, axis=-1)[..., -2:]
    return float((top[..., 1] - top[..., 0]).item())


@pytest.mark.parametrize("reduced", [False, True], ids=["target-vocab", "draft-vocab"])
def test_float32_at_load_drafts_like_the_quantized_drafter(reduced, tmp_path):
    drafter, t = _drafter("qwen3", reduced)
    quantize_drafter(drafter, bits=8, group_size=32)
    save_drafter(drafter, tmp_path / "q8")
    stored = load_drafter(tmp_path / "q8")
    fast = load_drafter(tmp_path / "q8", fastest=True)
    assert isinstance(stored.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in fast.named_modules())
    assert {v.dtype for k, v in tree_flatten(fast.parameters()) if k != "d2t"} == {mx.float32}
    assert fast.config.quantization is None
    assert fast.weights_form.startswith("8-bit quantized weights converted to float32 at load")
    assert stored.weights_form == "as stored"
    for d in (stored, fast):
        d.bind(drafter.binding)
    for seed in range(3):
        caches = [_context(d, t, length=9 + seed, seed=seed) for d in (stored, fast)]
        for block_ids in _blocks(fast):
            a, b = stored(block_ids, caches[0]), fast(block_ids, caches[1])
            # Same weights, summed in another order: logits agree to float32 rounding.
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
            qa, qb = stored.greedy_draft(block_ids, caches[0]), fast.greedy_draft(block_ids, caches[1])
            for slot, (x, y) in enumerate(zip(qa[0].tolist(), qb[0].tolist())):
                # Drafts may differ only where the quantized drafter's top two logits (nearly) tie.
                margin = _top2_margin(a[0, slot])
                assert x == y or margin < 1e-4, f"slot {slot}: {x} vs {y}, top-2 margin {margin:.2e}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_engine_greedy_path_commits_what_the_full_logits_path_commits(kind):
    class FullLogitsGreedy:  # greedy, but not a GreedyAcceptor: the engine takes the full-logits path
        def __init__(self):
            self.inner = GreedyAcceptor()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    prompt = prompt_ids(10, seed=3)
    for reduced in (False, True):
        drafter, t = _drafter(kind, reduced, block_size=4)
        fast_tokens, fast_cycles = run_dflash(prompt, t, drafter, max_tokens=20)
        full_tokens, full_cycles = run_dflash(prompt, t, drafter, max_tokens=20, acceptor=FullLogitsGreedy())
        assert fast_tokens == full_tokens == reference(kind, prompt, 20)
        assert [c.accepted for c in fast_cycles] == [c.accepted for c in full_cycles]
        # Draft trees: ranked over the drafter's own vocabulary (greedy), the same trees as over the full logits.
        fast_tokens, fast_cycles = run_dflash(prompt, t, drafter, max_tokens=20, width=4, tree_budget=6)
        full_tokens, full_cycles = run_dflash(prompt, t, drafter, max_tokens=20, width=4, tree_budget=6,
                                              acceptor=FullLogitsGreedy())
        assert fast_tokens == full_tokens == reference(kind, prompt, 20)
        assert any(c.width > 4 for c in fast_cycles)  # trees of up to 6 nodes were verified
        assert [(c.width, c.accepted) for c in fast_cycles] == [(c.width, c.accepted) for c in full_cycles]



def test_weights_stay_as_stored_when_the_default_device_is_a_gpu(tmp_path, monkeypatch):
    drafter, _ = _drafter("qwen3", True)
    quantize_drafter(drafter, bits=8, group_size=32)
    save_drafter(drafter, tmp_path / "q8")
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # only the decision reads it
    loaded = load_drafter(tmp_path / "q8", fastest=True)
    assert isinstance(loaded.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert loaded.config.quantization == {"group_size": 32, "bits": 8}
    assert loaded.weights_form == "8-bit quantized weights, as stored"
