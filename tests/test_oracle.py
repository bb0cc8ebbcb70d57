"""The oracle drafter proves the loop's bookkeeping: every block is accepted in full (tau == block size), and a
generator closed early leaves caches that hold exactly the committed tokens, ready to continue."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.decode.state import DecodeState
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel
from tiny import (
    CORE_KINDS, VOCAB, SteeredDFlashDrafter, corrupt_every, make_drafter, prompt_ids, reference, run_dflash, target,
)

MAX_TOKENS = 30


def _oracle(kind, prompt, block, max_tokens=MAX_TOKENS, mask=VOCAB - 1):
    sequence = list(prompt) + reference(kind, prompt, max_tokens)
    return OracleDrafter(sequence, VOCAB, block_size=block, mask_token_id=mask), TargetModel(target(kind), [0])


@pytest.mark.parametrize("kind", CORE_KINDS + ("llama_swa",))
@pytest.mark.parametrize("block", [2, 4, 7, 16])
def test_every_block_accepted_in_full(kind, block):
    prompt = prompt_ids(6, seed=block)
    oracle, t = _oracle(kind, prompt, block)
    tokens, cycles = run_dflash(prompt, t, oracle, max_tokens=MAX_TOKENS)
    assert tokens == reference(kind, prompt, MAX_TOKENS)
    assert cycles[0].is_prefill and cycles[0].tokens == tokens[:1]
    body = cycles[1:]
    for c in body[:-1]:
        assert c.width == block and c.accepted + 1 == block and len(c.tokens) == block
    last = body[-1]
    remaining = MAX_TOKENS - 1 - block * (len(body) - 1)
    assert last.width == remaining == last.accepted + 1 == len(last.tokens)
    assert len(body) == -(-(MAX_TOKENS - 1) // block)  # ceil: the fewest verify passes possible


def test_oracle_defaults_come_from_its_config():
    prompt = prompt_ids(3)
    oracle, t = _oracle("qwen3", prompt, block=5)
    tokens, cycles = run_dflash(prompt, t, oracle, max_tokens=12)  # block size and mask id from the drafter
    assert tokens == reference("qwen3", prompt, 12)
    assert [c.width for c in cycles] == [1, 5, 5, 1]


# -- stopping early ------------------------------------------------------------------------------------------
def _fresh_context(t, drafter, sequence):
    """Draft context and features computed in one go for `sequence` (what the caches should amount to)."""
    _, feats = t(mx.array([sequence]))
    cache = drafter.make_cache()
    drafter.append_context(feats, cache)
    return cache, feats


def _assert_consistent(t, drafter, state, prompt, committed):
    """Target cache = prompt + committed[:-1]; draft cache + pending features = the same tokens' context."""
    n = len(prompt) + len(committed) - 1
    assert all(c.offset == n for c in state.target_cache)
    assert state.last_token == committed[-1]
    pending = 0 if state.pending_context is None else state.pending_context.shape[1]
    offsets = {c.offset for c in state.draft_cache}
    assert len(offsets) == 1 and offsets.pop() + pending == n
    if not hasattr(drafter, "layers"):
        return  # the oracle's cache is a position counter
    fresh, feats = _fresh_context(t, drafter, list(prompt) + committed[:-1])
    k = state.draft_cache[0].offset
    for ours, ref in zip(state.draft_cache, fresh):
        np.testing.assert_allclose(np.array(ours.keys[..., :k, :]), np.array(ref.keys[..., :k, :]), atol=1e-4)
        np.testing.assert_allclose(np.array(ours.values[..., :k, :]), np.array(ref.values[..., :k, :]), atol=1e-4)
    if pending:
        np.testing.assert_allclose(np.array(state.pending_context), np.array(feats[:, k:]), atol=1e-4)
    # And the target cache continues exactly like a fresh forward over the same tokens.
    logits, _ = t(mx.array([[committed[-1]]]), state.target_cache)
    full = t.model(mx.array([list(prompt) + committed]))
    np.testing.assert_allclose(np.array(logits[0, -1]), np.array(full[0, -1]), atol=1e-4)
    t.rollback(state.target_cache, 1)


def _steered(kind, prompt, block, spoil=3):
    drafter, t = make_drafter(target(kind), block_size=block, drafter_class=SteeredDFlashDrafter)
    drafter.steer(list(prompt) + reference(kind, prompt, MAX_TOKENS), corrupt_every(spoil))
    return drafter, t


@pytest.mark.parametrize("kind", ["qwen3", "llama_swa"])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])
def test_close_early_rolls_back(kind, stop_after):
    prompt = prompt_ids(7, seed=stop_after)
    for drafter, t in (_oracle(kind, prompt, 4), _steered(kind, prompt, 4)):
        state = DecodeState(t.make_cache(), drafter.make_cache())
        tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS, state=state, stop_after=stop_after)
        assert len(cycles) == stop_after
        assert tokens == reference(kind, prompt, MAX_TOKENS)[: len(tokens)]
        _assert_consistent(t, drafter, state, prompt, tokens)


@pytest.mark.parametrize("how", ["max_tokens", "stop_token"])
def test_state_after_a_complete_run(how):
    kind, prompt = "llama", prompt_ids(5, seed=9)
    drafter, t = _steered(kind, prompt, 4)
    want = reference(kind, prompt, 17)
    stop = [want[10]] if how == "stop_token" else []
    state = DecodeState(t.make_cache(), drafter.make_cache())
    tokens, _ = run_dflash(prompt, t, drafter, max_tokens=17, state=state, stop_tokens=stop)
    assert tokens == reference(kind, prompt, 17, stop_tokens=stop)
    _assert_consistent(t, drafter, state, prompt, tokens)


@pytest.mark.parametrize("kind", ["qwen2", "llama_swa"])
def test_continue_from_state(kind):
    # Stop early, then continue with more prompt tokens (a later chat turn): the result equals greedy decoding of
    # the whole conversation, and the draft context equals one computed from scratch.
    prompt = prompt_ids(6, seed=21)
    drafter, t = _steered(kind, prompt, 4)
    state = DecodeState(t.make_cache(), drafter.make_cache())
    first, _ = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS, state=state, stop_after=3)
    turn = prompt_ids(4, seed=22)
    history = prompt + first + turn
    want = reference(kind, history, 12)
    drafter.steer(history + want, corrupt_every(3))
    second, _ = run_dflash(turn, t, drafter, max_tokens=12, state=state)
    assert second == want
    _assert_consistent(t, drafter, state, prompt + first + turn, second)
