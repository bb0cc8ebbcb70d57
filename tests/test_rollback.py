"""Rollback exactness for every target family: a cache rolled back to k accepted tokens is bit-identical (fp32) to
the cache of a target that processed only those tokens, for every k in 0..B-1; and the rollback machinery's
contracts (no work on a full accept, refusal where it cannot be exact, pluggable recurrent strategies)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_update

from cache_compare import ALL, HYBRID, VOCAB, WINDOW, WINDOWED, assert_caches_equal, prompt, shared
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.errors import DFlashError
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.hybrid import GatedDeltaCache, RecurrentRollback, ReplayRollback
from dflash_mlx.targets.rotating import WindowKVCache

# deepseek_v3's MLA attention takes another code path for one-token writes (absorbed projections), so its
# reference for k = 1 is the prompt and the accepted token in one write.
_ONE_TOKEN_PATH = {"deepseek_v3"}


def _eval(cache):
    mx.eval([c.state for c in cache])


def _rolled_back(t: TargetModel, ids: mx.array, P: int, B: int, k: int):
    cache = t.make_cache()
    t(ids[:, :P], cache)
    t(ids[:, P : P + B], cache)
    t.rollback(cache, B - k)
    _eval(cache)
    return cache


def _reference(t: TargetModel, ids: mx.array, P: int, k: int, kind: str):
    cache = t.make_cache()
    if k == 1 and kind in _ONE_TOKEN_PATH:
        t(ids[:, : P + 1], cache)
    else:
        t(ids[:, :P], cache)
        if k:
            t(ids[:, P : P + k], cache)
    _eval(cache)
    return cache


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("P", [5, 3 * WINDOW - 1])  # shorter and longer than the sliding window
def test_rollback_matches_target_that_saw_only_accepted_tokens(kind, P):
    t = TargetModel(shared(kind))
    B = 5
    ids = mx.array(prompt(P + B, seed=P), dtype=mx.int32)[None]
    for k in range(B):
        assert_caches_equal(_rolled_back(t, ids, P, B, k), _reference(t, ids, P, k, kind))


@pytest.mark.parametrize("kind", ["qwen3_5", "gpt_oss"])
def test_checks_are_not_vacuous(kind):
    """An off-by-one rollback is told apart; and mlx-lm's own caches, merely trimmed, go wrong where ours do not."""
    t = TargetModel(shared(kind))
    P, B = 3 * WINDOW - 1, 4
    ids = mx.array(prompt(P + B + 2, seed=1), dtype=mx.int32)[None]
    with pytest.raises(AssertionError):
        assert_caches_equal(_rolled_back(t, ids, P, B, 1), _reference(t, ids, P, 2, kind))
    naive = make_prompt_cache(t.model)
    for c in naive:
        if isinstance(c, ArraysCache):
            c.trim = lambda n: n  # "trimming" a recurrent cache without restoring its state
    t(ids[:, :P], naive)
    t(ids[:, P : P + B], naive)
    for c in naive:
        c.trim(B - 1)
    ours, ref = _rolled_back(t, ids, P, B, 1), _reference(t, ids, P, 1, kind)
    logits = [t(ids[:, P + 1 : P + 2], c)[0] for c in (naive, ours, ref)]
    assert mx.array_equal(logits[1], logits[2]).item()
    assert mx.abs(logits[0] - logits[2]).max().item() > 1e-3


@pytest.mark.parametrize("kind", ["qwen3_5", "gpt_oss", "gemma4_text"])
def test_rollback_of_block_longer_than_window(kind):
    # B = 16 > window 8: the verify write alone overruns the sliding window.
    t = TargetModel(shared(kind))
    P, B = 13, 16
    ids = mx.array(prompt(P + B, seed=3), dtype=mx.int32)[None]
    for k in range(B):
        assert_caches_equal(_rolled_back(t, ids, P, B, k), _reference(t, ids, P, k, kind))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "gemma3", "gpt_oss"])
def test_decode_cycles_match_chunked_reference(kind):
    """Many verify/rollback cycles (random accept lengths) leave the caches and the next logits bit-identical to a
    target fed just the accepted tokens, one accepted segment per write."""
    t = TargetModel(shared(kind))
    rng = np.random.default_rng(7)
    seq = prompt(80, seed=11)
    ours, ref = t.make_cache(), t.make_cache()
    P = 6
    t(mx.array(seq[:P])[None], ours)
    t(mx.array(seq[:P])[None], ref)
    pos = P
    for _ in range(10):
        B = int(rng.choice([2, 4, 6]))
        keep = int(rng.integers(1, B + 1))  # committed tokens of the block (>= 1: slot 0 is always kept)
        t(mx.array(seq[pos : pos + B])[None], ours)
        t.rollback(ours, B - keep)
        t(mx.array(seq[pos : pos + keep])[None], ref)
        pos += keep
    _eval(ours)
    _eval(ref)
    assert_caches_equal(ours, ref)
    step = mx.array(seq[pos : pos + 3])[None]
    assert mx.array_equal(t(step, ours)[0], t(step, ref)[0]).item()


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_generation_closed_early_leaves_only_committed_tokens(kind):
    """The engine undoes a queued verify when the caller stops: a whole-write rollback (the pre-verify snapshot)."""
    t = TargetModel(shared(kind))
    ids = prompt(3 * WINDOW - 1)
    drafter = OracleDrafter(ids + [1, 2, 3] * 20, VOCAB, block_size=4)
    state = DecodeState(t.make_cache(), drafter.make_cache())
    committed = []
    gen = dflash_generate_step(mx.array(ids), t, drafter, max_tokens=40, width=4, state=state)
    for i, cycle in enumerate(gen):
        committed += cycle.tokens
        if i == 3:
            gen.close()
            break
    _eval(state.target_cache)
    seen = mx.array(ids + committed[:-1], dtype=mx.int32)[None]  # the newest token is not in the cache yet
    ref = t.make_cache()
    t(seen[:, : len(ids)], ref)
    t(seen[:, len(ids) :], ref)
    _eval(ref)
    assert_caches_equal(state.target_cache, ref)


# -- GatedDeltaNet rollback contracts -----------------------------------------------------------------------------
class CountingReplay(ReplayRollback):
    def __init__(self):
        self.restores = []

    def restore(self, write, keep):
        self.restores.append(keep)
        return super().restore(write, keep)


class StepStatesRollback(RecurrentRollback):
    """Another scheme through the same interface (S4): keep the state after every step, select on rollback."""

    name = "step-states"

    def advance(self, q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel):
        ys, states = [], []
        for i in range(q.shape[1]):
            y, state = gated_delta_update(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], a[:, i : i + 1],
                                          b[:, i : i + 1], A_log, dt_bias, state, use_kernel=use_kernel)
            ys.append(y)
            states.append(state)
        return mx.concatenate(ys, axis=1), state, states

    def restore(self, write, keep):
        if keep == 0:
            return write.conv_state, write.state
        n = write.conv_input.shape[1] - write.num_tokens
        return write.conv_input[:, keep : keep + n], write.tape[keep - 1]


def test_full_accept_does_no_rollback_work():
    strategy = CountingReplay()
    t = TargetModel(shared("qwen3_5"), recurrent_rollback=strategy)
    cache = t.make_cache()
    ids = mx.array(prompt(12), dtype=mx.int32)[None]
    t(ids[:, :6], cache)
    t(ids[:, 6:10], cache)
    t.rollback(cache, 0)
    assert strategy.restores == []
    t.rollback(cache, 3)
    assert strategy.restores == [1, 1]  # one replay of 1 kept token per GatedDeltaNet layer


def test_consecutive_trims_within_one_write():
    t = TargetModel(shared("qwen3_next"))
    ids = mx.array(prompt(14), dtype=mx.int32)[None]
    cache = t.make_cache()
    t(ids[:, :6], cache)
    t(ids[:, 6:12], cache)
    t.rollback(cache, 2)
    t.rollback(cache, 3)
    _eval(cache)
    assert_caches_equal(cache, _reference(t, ids, 6, 1, "qwen3_next"))


def test_pluggable_recurrent_strategy_is_exact():
    base = shared("qwen3_5")
    t = TargetModel(base, recurrent_rollback=StepStatesRollback())
    ref = TargetModel(base)
    P, B = 7, 5
    ids = mx.array(prompt(P + B, seed=5), dtype=mx.int32)[None]
    for k in range(B):
        ours = _rolled_back(t, ids, P, B, k)
        assert_caches_equal(ours, _reference(ref, ids, P, k, "qwen3_5"))


class BrokenRollback(ReplayRollback):
    def restore(self, write, keep):
        return write.conv_input[:, -(write.conv_input.shape[1] - write.num_tokens):], None  # forgets the state


def test_parity_probe_catches_a_wrong_rollback():
    with pytest.raises(DFlashError, match="step after rollback"):
        TargetModel(shared("qwen3_5"), recurrent_rollback=BrokenRollback()).probe_parity()


def test_gated_delta_rollback_refuses_what_it_cannot_undo():
    t = TargetModel(shared("qwen3_5"))
    ids = mx.array(prompt(12), dtype=mx.int32)[None]
    cache = t.make_cache()
    t(ids[:, :6], cache)
    t(ids[:, 6:9], cache)
    with pytest.raises(DFlashError, match="newest write"):
        cache[0].trim(4)  # more than the newest write holds
    t.model(ids[:, 9:11], cache=cache)  # mlx-lm's own call writes without a record
    with pytest.raises(DFlashError, match="without a record"):
        t.rollback(cache, 1)


def test_long_prefill_chunks_are_not_recorded():
    t = TargetModel(shared("qwen3_5"))
    cache = t.make_cache()
    long = ReplayRollback.max_record_tokens + 1
    t(mx.array(prompt(long), dtype=mx.int32)[None], cache)
    assert all(c.last_write is None for c in cache if isinstance(c, GatedDeltaCache))


def test_make_cache_swaps_in_rollback_capable_caches():
    for kind in HYBRID:
        types = {type(c) for c in TargetModel(shared(kind)).make_cache()}
        assert GatedDeltaCache in types and ArraysCache not in types
    for kind in WINDOWED:
        types = {type(c) for c in TargetModel(shared(kind)).make_cache()}
        assert WindowKVCache in types and RotatingKVCache not in types


@pytest.mark.parametrize("kind", ["qwen3_5", "gpt_oss"])
def test_mlx_lm_caches_are_refused(kind):
    t = TargetModel(shared(kind))
    with pytest.raises(DFlashError, match="make_cache"):
        t.check_rollback_supported(make_prompt_cache(t.model))
    t.check_rollback_supported(t.make_cache())


# -- WindowKVCache ----------------------------------------------------------------------------------------------
def test_window_cache_keeps_exactly_what_queries_see():
    """Random writes and trims of a token stream: the buffer always ends with the last window-1 committed tokens
    plus the newest write, and mlx-lm's mask covers the buffer exactly."""
    W = 6
    rng = np.random.default_rng(0)
    cache = WindowKVCache(W)
    committed = []  # token ids standing in for keys
    for _ in range(60):
        S = int(rng.integers(1, 2 * W + 2))
        new = list(range(len(committed) + 1000, len(committed) + 1000 + S))
        mask = cache.make_mask(S, window_size=W)
        kv = mx.array(new, dtype=mx.float32).reshape(1, 1, S, 1)
        keys, _ = cache.update_and_fetch(kv, kv)
        history = committed[-(W - 1):] if committed else []
        assert keys[0, 0, :, 0].tolist() == history + new
        # mask: query i sees its own key and the W-1 before it, nothing later
        full = np.array([[0 <= (len(history) + i) - j < W for j in range(len(history) + S)] for i in range(S)])
        if mask is None:
            assert full.all()
        elif isinstance(mask, str):
            assert mask == "causal" and (full == np.tril(np.ones_like(full), len(history))).all()
        else:
            assert (np.array(mask) == full).all()
        keep = int(rng.integers(1, S + 1))
        cache.trim(S - keep)
        committed += new[:keep]
        assert cache.offset == len(committed)
    with pytest.raises(DFlashError, match="newest write"):
        cache.trim(cache.offset)
