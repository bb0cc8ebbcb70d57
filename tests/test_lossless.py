"""Greedy DFlash is lossless: token for token what mlx-lm's own `generate_step` produces, in fp32.

Random drafters exercise the all-rejected path; steered drafters (a real DFlash drafter, or the oracle, whose
proposals are the reference continuation with chosen positions spoiled) exercise partial and full acceptance.
A divergence here is a bug: `_first_divergence` reports the target's logit margin there, never a loosened check.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.decode.state import DecodeState
from dflash_mlx.targets import TargetModel
from tiny import (
    ALL_KINDS, CORE_KINDS, VOCAB, SteeredDFlashDrafter, SteeredOracle, corrupt_every, make_drafter, prompt_ids,
    reference, run_dflash, target,
)

PROMPT_LENGTHS = (1, 5, 40)
MAX_TOKENS = 23  # not a multiple of any tested block size
SHORT = 11  # random drafters commit one token per cycle: keep those runs short


def _first_divergence(kind, prompt, got, want):
    """Message naming the first differing token and the target's top-2 logit margin given the shared prefix."""
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i >= min(len(got), len(want)):
        return f"length differs: got {len(got)} tokens, want {len(want)}"
    logits = np.array(target(kind)(mx.array([list(prompt) + want[:i]]))[0, -1])
    top = np.sort(logits)[::-1]
    return (f"first divergence at token {i}: got {got[i]}, want {want[i]}; "
            f"target logit margin there {top[0] - top[1]:.3g} (got-token logit {logits[got[i]]:.4g})")


def target_model(kind):
    """The tapped wrapper for drafter-less and oracle runs (the tap is unused)."""
    return TargetModel(target(kind), [0])


def _assert_lossless(kind, prompt, got, want):
    assert got == want, _first_divergence(kind, prompt, got, want)


@pytest.mark.parametrize("kind", CORE_KINDS)
@pytest.mark.parametrize("block", [1, 2, 4, 16])
def test_random_drafter(kind, block):
    drafter, t = make_drafter(target(kind), block_size=block)
    for n in PROMPT_LENGTHS:
        prompt = prompt_ids(n, seed=n)
        tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=SHORT)
        _assert_lossless(kind, prompt, tokens, reference(kind, prompt, SHORT))
        assert cycles[0].is_prefill and all(c.width <= block for c in cycles)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_no_drafter_is_plain_greedy(kind):
    prompt = prompt_ids(5, seed=5)
    tokens, cycles = run_dflash(prompt, target_model(kind), None, max_tokens=SHORT)
    _assert_lossless(kind, prompt, tokens, reference(kind, prompt, SHORT))
    assert all(len(c.tokens) == 1 for c in cycles)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("block, spoil", [(4, 3), (16, 5)])
def test_partial_acceptance(kind, block, spoil):
    # llama_swa: 40-token prompts run far past its 8-token window, so verify blocks roll back wrapped windows.
    drafter, t = make_drafter(target(kind), block_size=block, drafter_class=SteeredDFlashDrafter)
    accepted = set()
    for n in (5, 40):
        prompt = prompt_ids(n, seed=n)
        want = reference(kind, prompt, MAX_TOKENS)
        drafter.steer(prompt + want, corrupt_every(spoil, phase=n))
        tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS)
        _assert_lossless(kind, prompt, tokens, want)
        accepted |= {c.accepted for c in cycles[1:]}
    assert len(accepted) > 1 and max(accepted) > 0  # both partial and (near-)full acceptances happened


@pytest.mark.parametrize("kind", CORE_KINDS + ("llama_swa",))
def test_chunked_prefill(kind):
    # A prompt longer than the prefill chunk, split unevenly (40 = 16 + 16 + 8), with and without acceptances.
    prompt = prompt_ids(40, seed=40)
    want = reference(kind, prompt, MAX_TOKENS)
    drafter, t = make_drafter(target(kind), block_size=4, drafter_class=SteeredDFlashDrafter)
    drafter.steer(prompt + want, corrupt_every(3))
    for step in (16, 7, 40):
        tokens, _ = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS, prefill_step_size=step)
        _assert_lossless(kind, prompt, tokens, want)


def test_chunked_prefill_fills_draft_context_like_one_chunk():
    kind = "qwen3"
    prompt = prompt_ids(40, seed=40)
    drafter, t = make_drafter(target(kind), block_size=4)
    caches = []
    for step in (16, 2048):
        state = DecodeState(t.make_cache(), drafter.make_cache())
        run_dflash(prompt, t, drafter, max_tokens=1, prefill_step_size=step, state=state)
        caches.append(state.draft_cache)
    for a, b in zip(*caches):
        assert a.offset == b.offset == 40
        np.testing.assert_allclose(np.array(a.keys[..., :40, :]), np.array(b.keys[..., :40, :]), atol=1e-5)
        np.testing.assert_allclose(np.array(a.values[..., :40, :]), np.array(b.values[..., :40, :]), atol=1e-5)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 17])
@pytest.mark.parametrize("block", [4, 16])
def test_max_tokens_exact(max_tokens, block):
    kind = "qwen2"
    prompt = prompt_ids(5, seed=1)
    want = reference(kind, prompt, max_tokens)
    assert len(want) == max_tokens
    oracle = SteeredOracle(prompt + want + [0] * 32, VOCAB, block, VOCAB - 1, corrupt_every(1000))
    t = target_model(kind)
    tokens, cycles = run_dflash(prompt, t, oracle, max_tokens=max_tokens)
    assert tokens == want
    # Full accepts: the last block is clamped to what is left, never verifying past max_tokens.
    assert sum(c.width for c in cycles[1:]) == max_tokens - 1


def _stop_inside_block(kind, prompt, block, max_tokens=40):
    """A token whose first occurrence in the reference output sits strictly inside an oracle block."""
    want = reference(kind, prompt, max_tokens)
    for j, tok in enumerate(want):
        slot = (j - 1) % block  # oracle cycles commit want[1 + block*(c-1) : 1 + block*c]
        if j >= 1 and want.index(tok) == j and slot < block - 1:
            return tok, j
    return None, None


@pytest.mark.parametrize("kind", CORE_KINDS)
@pytest.mark.parametrize("block", [4, 16])
def test_stop_token_inside_block(kind, block):
    prompt = prompt_ids(5, seed=7)
    stop, j = _stop_inside_block(kind, prompt, block)
    assert stop is not None, "no usable stop token in the reference output"
    want = reference(kind, prompt, 40, stop_tokens=[stop])
    assert len(want) == j + 1 and want[-1] == stop
    drafter, t = make_drafter(target(kind), block_size=block, drafter_class=SteeredDFlashDrafter)
    drafter.steer(prompt + reference(kind, prompt, 40), corrupt_every(1000))
    state = DecodeState(t.make_cache(), drafter.make_cache())
    tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=40, stop_tokens=[stop], state=state)
    assert tokens == want
    last = cycles[-1]
    assert last.tokens[-1] == stop and len(last.tokens) < last.width  # cut inside the block
    assert last.accepted >= len(last.tokens)  # the stop token was an accepted draft, not the bonus
    # Caches hold exactly the committed prefix (the stop token itself is not in the target cache).
    assert all(c.offset == len(prompt) + len(tokens) - 1 for c in state.target_cache)


@pytest.mark.parametrize("block", [1, 4])
def test_stop_token_as_bonus_and_first_token(block):
    kind = "mistral"
    prompt = prompt_ids(5, seed=3)
    full = reference(kind, prompt, 30)
    drafter, t = make_drafter(target(kind), block_size=block)
    # The prefill's token itself.
    tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=30, stop_tokens=[full[0]])
    assert tokens == [full[0]] and len(cycles) == 1
    # A later token (random drafter: every token is a bonus); several stop ids, the earliest wins.
    j = next(j for j, tok in enumerate(full) if j >= 3 and full.index(tok) == j)
    later = next((tok for tok in full[j + 1:] if tok not in full[:j + 1]), VOCAB + 5)
    tokens, _ = run_dflash(prompt, t, drafter, max_tokens=30, stop_tokens=[later, full[j]])
    assert tokens == full[: j + 1]


@pytest.mark.parametrize("kind", CORE_KINDS)
def test_tokens_equal_to_mask_id_are_kept(kind):
    prompt = prompt_ids(5, seed=11)
    want = reference(kind, prompt, MAX_TOKENS)
    mask = max(set(want[1:]), key=want[1:].count)  # a token the target really generates, often
    for drafter_class in (None, SteeredDFlashDrafter):
        drafter, t = make_drafter(target(kind), block_size=4, mask_token_id=mask,
                                  **({"drafter_class": drafter_class} if drafter_class else {}))
        if drafter_class:
            drafter.steer(prompt + want, corrupt_every(4))
        tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS)
        _assert_lossless(kind, prompt, tokens, want)
        assert tokens.count(mask) == want.count(mask) >= 2


def test_committed_logits_are_the_targets_given_the_prefix():
    # Cycle.logits row i is the target's distribution for tokens[i] given the committed prefix.
    kind = "qwen3"
    prompt = prompt_ids(5, seed=2)
    want = reference(kind, prompt, MAX_TOKENS)
    drafter, t = make_drafter(target(kind), block_size=4, drafter_class=SteeredDFlashDrafter)
    drafter.steer(prompt + want, corrupt_every(3))
    tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=MAX_TOKENS)
    full = np.array(target(kind)(mx.array([prompt + tokens]))[0])
    pos = len(prompt) - 1
    for c in cycles:
        n = len(c.tokens)
        rows = np.array(c.logits)
        assert rows.shape == (n, VOCAB)
        np.testing.assert_allclose(rows, full[pos:pos + n], atol=1e-4)
        assert list(rows.argmax(-1)) == c.tokens
        pos += n


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=8, derandomize=True)
    @given(
        kind=st.sampled_from(CORE_KINDS + ("llama_swa",)),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
        block=st.integers(1, 9),
        spoil=st.integers(2, 7),
        phase=st.integers(0, 6),
        max_tokens=st.integers(1, 20),
        step=st.sampled_from([3, 2048]),
    )
    def test_property_lossless(kind, prompt, block, spoil, phase, max_tokens, step):
        want = reference(kind, prompt, max_tokens)
        drafter, t = _property_drafter(kind)
        drafter.steer(prompt + want, corrupt_every(spoil, phase))
        tokens, cycles = run_dflash(prompt, t, drafter, max_tokens=max_tokens, width=block,
                                    prefill_step_size=step)
        _assert_lossless(kind, prompt, tokens, want)
        assert all(c.accepted + 1 >= len(c.tokens) for c in cycles)


_DRAFTERS = {}


def _property_drafter(kind):
    if kind not in _DRAFTERS:
        _DRAFTERS[kind] = make_drafter(target(kind), block_size=4, drafter_class=SteeredDFlashDrafter)
    return _DRAFTERS[kind]
