"""mlx-lm's cache protocol on our cache classes (`WindowKVCache`, `GatedDeltaCache`) and on mlx-lm's `KVCache`:
save/load round trips that a model continues from exactly, `state` after `trim`, `is_trimmable` / `can_trim`,
independent copies and `nbytes`. Tiny caches and models built in code."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache

from cache_compare import assert_caches_equal, prompt, shared
from dflash_mlx.errors import DFlashError
from dflash_mlx.server.prefix_cache import Snapshot
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.caches import can_trim, copy_cache, load_prompt_cache, save_prompt_cache
from dflash_mlx.targets.hybrid import GatedDeltaCache, ReplayRollback, TapeRollback
from dflash_mlx.targets.rotating import WindowKVCache
from tiny import make_drafter, target

# A target family per cache class: its caches are that class (and KVCache for the full-attention layers).
FAMILIES = {"KVCache": "qwen3", "WindowKVCache": "gemma3_text", "GatedDeltaCache": "qwen3_5"}


def _target(cls_name: str) -> TargetModel:
    family = FAMILIES[cls_name]
    model = target(family) if family == "qwen3" else shared(family)
    return TargetModel(model, [0])


def _ids(n: int, seed: int = 0) -> mx.array:
    return mx.array([prompt(n, seed)])


def _kv(n: int, seed: int = 0, heads: int = 2, dim: int = 4):
    mx.random.seed(seed)
    return mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim))


def _arrays(state):
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


# -- save / load ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls_name", list(FAMILIES))
def test_round_trip_is_exact_and_a_model_continues_alike(tmp_path, cls_name):
    t = _target(cls_name)
    cache = t.make_cache()
    assert cls_name in {type(c).__name__ for c in cache}
    t(_ids(20, seed=1), cache)  # past the window of the windowed family
    t(_ids(4, seed=2), cache)  # a verify block ...
    t.rollback(cache, 3)  # ... of which one token was kept
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"note": "kept"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"note": "kept"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert_caches_equal(loaded, cache)
    for a, b in zip(loaded, cache):
        assert getattr(a, "offset", None) == getattr(b, "offset", None)
        sa, sb = _arrays(a.state), _arrays(b.state)
        assert len(sa) == len(sb) and all(mx.array_equal(x, y).item() for x, y in zip(sa, sb))
    # Both continue alike: a block, a rollback of part of it, a single step.
    for ids in (_ids(5, seed=3), None, _ids(1, seed=4)):
        if ids is None:
            t.rollback(cache, 2)
            t.rollback(loaded, 2)
            continue
        ours, theirs = t(ids, loaded)[0], t(ids, cache)[0]
        assert mx.array_equal(ours, theirs).item()


def test_drafter_caches_round_trip(tmp_path):
    model = target("qwen3")
    drafter, t = make_drafter(model)
    _, hidden = t(_ids(9, seed=5), t.make_cache())
    dcache = drafter.make_cache()
    drafter.append_context(hidden, dcache)
    path = str(tmp_path / "draft.safetensors")
    save_prompt_cache(path, dcache)
    loaded = load_prompt_cache(path)
    assert_caches_equal(loaded, dcache)
    block = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(drafter(block, loaded), drafter(block, dcache)).item()


def test_mlx_lm_loader_reads_our_files_of_its_classes_only(tmp_path):
    kv, window = KVCache(), WindowKVCache(4)
    kv.update_and_fetch(*_kv(3))
    window.update_and_fetch(*_kv(6))
    path = str(tmp_path / "kv.safetensors")
    save_prompt_cache(path, [kv])
    (theirs,) = mlx_load_prompt_cache(path)
    assert_caches_equal([theirs], [kv])
    save_prompt_cache(path, [kv, window])
    with pytest.raises(KeyError, match="WindowKVCache"):  # mlx-lm looks names up in its own module only
        mlx_load_prompt_cache(path)
    assert_caches_equal(load_prompt_cache(path), [kv, window])


def test_reloaded_gated_delta_cache_keeps_its_rollback_scheme(tmp_path):
    path = str(tmp_path / "gdn.safetensors")
    for scheme in (ReplayRollback(), TapeRollback()):
        c = GatedDeltaCache(scheme)
        c[0], c[1] = mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4))
        save_prompt_cache(path, [c])
        (loaded,) = load_prompt_cache(path)
        assert type(loaded.rollback) is type(scheme)
        assert loaded.last_write is None
        with pytest.raises(DFlashError):  # the record of the last write is not saved
            loaded.trim(1)


# -- state after trim -------------------------------------------------------------------------------------------
def test_window_state_after_trim_holds_only_live_rows():
    full, short = WindowKVCache(4), WindowKVCache(4)
    k, v = _kv(9)
    for c, n in ((full, 9), (short, 7)):
        c.update_and_fetch(k[..., :6, :], v[..., :6, :])
        c.update_and_fetch(k[..., 6:n, :], v[..., 6:n, :])
    full.trim(2)
    keys, values, offset, keep, max_size, idx = full.state
    assert keys.shape[2] == values.shape[2] == idx == 3 + 1  # the window before the block, then its kept token
    assert (offset, keep, max_size) == (7, 0, 4)
    ref = short.state
    assert mx.array_equal(keys, ref[0]).item() and mx.array_equal(values, ref[1]).item()
    assert mx.array_equal(keys, k[..., 3:7, :]).item()


def test_gated_delta_state_after_trim_is_the_kept_prefix():
    t = _target("GatedDeltaCache")
    cache, ref = t.make_cache(), t.make_cache()
    t(_ids(10, seed=6), cache)
    t(_ids(10, seed=6)[:, :7], ref)
    t.rollback(cache, 3)
    for c, r in zip(cache, ref):
        if isinstance(c, GatedDeltaCache):
            conv, state = c.state[0]
            assert mx.array_equal(conv, r.state[0][0]).item()
            assert mx.array_equal(state, r.state[0][1]).item()


def test_kv_cache_offset_marks_the_live_rows_of_its_state():
    # mlx-lm's KVCache keeps its step-sized buffer in `state`; `offset` says which rows are live.
    c = KVCache()
    k, v = _kv(5)
    c.update_and_fetch(k, v)
    c.trim(2)
    keys, values, offset = c.state
    assert offset == 3 and mx.array_equal(keys[..., :offset, :], k[..., :3, :]).item()


# -- is_trimmable / can_trim ------------------------------------------------------------------------------------
def test_is_trimmable_and_can_trim():
    window, gdn, kv = WindowKVCache(4), GatedDeltaCache(), KVCache()
    window.update_and_fetch(*_kv(9))  # well past its window: still trimmable, unlike mlx-lm's RotatingKVCache
    kv.update_and_fetch(*_kv(9))
    rotating = RotatingKVCache(4)
    rotating.update_and_fetch(*_kv(9))
    assert window.is_trimmable() and gdn.is_trimmable() and kv.is_trimmable()
    assert not rotating.is_trimmable()
    # Cut back to any length: mlx-lm's plain KV caches only. Ours drop only their newest write.
    assert can_trim(kv) and can_trim(KVCache()) and can_trim(QuantizedKVCache())
    assert not any(can_trim(c) for c in (window, gdn, rotating, RotatingKVCache(4), ArraysCache(2)))
    with pytest.raises(DFlashError):
        window.update_and_fetch(*_kv(2))
        window.trim(3)


# -- copies -----------------------------------------------------------------------------------------------------
def _held(cache) -> list:
    """The values of a cache's state arrays, as copies no later write can reach."""
    return [np.array(a) for a in _arrays(cache.state)]


def _holds(cache, held) -> bool:
    now = _held(cache)
    return len(now) == len(held) and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(now, held))


@pytest.mark.parametrize("cls_name", list(FAMILIES))
def test_copy_is_independent(cls_name):
    t = _target(cls_name)
    cache = t.make_cache()
    t(_ids(12, seed=7), cache)
    mx.eval([c.state for c in cache])
    twins = [copy_cache(c) for c in cache]
    before = [_held(c) for c in cache]
    assert all(type(a) is type(b) for a, b in zip(twins, cache))
    assert_caches_equal(twins, cache)
    # Writes (in place where the buffer has room) and rollbacks of the original leave the copy as it was ...
    t(_ids(3, seed=8), cache)
    t.rollback(cache, 2)
    t(_ids(1, seed=9), cache)
    mx.eval([c.state for c in cache])
    assert all(_holds(c, held) for c, held in zip(twins, before))
    # ... and the copy is a live cache of its own, whose writes do not reach the original.
    after = [_held(c) for c in cache]
    logits = t(_ids(2, seed=10), twins)[0]
    mx.eval(logits, [c.state for c in twins])
    assert all(_holds(c, held) for c, held in zip(cache, after))
    ref = t.make_cache()
    t(mx.concatenate([_ids(12, seed=7), _ids(2, seed=10)], axis=1), ref)
    assert_caches_equal(twins, ref)


def test_gated_delta_copy_leaves_the_record_behind():
    t = _target("GatedDeltaCache")
    cache = t.make_cache()
    t(_ids(6, seed=11), cache)
    gdn = next(c for c in cache if isinstance(c, GatedDeltaCache))
    twin = gdn.copy()
    assert twin.last_write is None and twin.rollback is gdn.rollback
    assert gdn.trim(2) == 2  # the original still rolls back its last write
    with pytest.raises(DFlashError):
        twin.trim(1)


# -- nbytes -----------------------------------------------------------------------------------------------------
def test_nbytes():
    f32 = 4
    kv = KVCache()
    kv.update_and_fetch(*_kv(5))
    assert kv.nbytes == 2 * (1 * 2 * KVCache.step * 4) * f32  # mlx-lm's step-sized buffer
    window = WindowKVCache(4)
    window.update_and_fetch(*_kv(6))
    window.update_and_fetch(*_kv(3, seed=1))
    assert window.nbytes == 2 * (1 * 2 * (3 + 3) * 4) * f32  # the window before the block, then the block
    window.trim(2)
    assert window.nbytes == 2 * (1 * 2 * 6 * 4) * f32  # dropped rows stay in the buffer until the next write
    assert window.copy().nbytes == 2 * (1 * 2 * 4 * 4) * f32  # a copy holds the live rows
    assert WindowKVCache(4).nbytes == 0

    t = _target("GatedDeltaCache")
    cache = t.make_cache()
    t(_ids(6, seed=12), cache)
    gdn = next(c for c in cache if isinstance(c, GatedDeltaCache))
    conv, state = gdn.state[0]
    assert gdn.nbytes == conv.size * conv.itemsize + state.size * state.itemsize  # the record is not counted
    assert gdn.copy().nbytes == gdn.nbytes

    # A prefix-cache snapshot is charged what its live caches and pending features hold.
    pending = mx.zeros((1, 2, 8))
    snap = Snapshot.take(cache, None, pending, 6)
    assert snap.nbytes == sum(c.nbytes for c in cache) + pending.nbytes
    assert not snap.cuttable
