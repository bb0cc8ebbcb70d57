"""Tree verify (`dflash_mlx.targets.tree`): one batched pass over a draft tree equals chain passes of its paths, and
committing a path leaves caches that continue like a fresh prefill of those tokens, on every target family.

In float32 not bit-exact here: the tree runs n+1 one-token rows where a chain runs one T-token row, and the OpenBLAS
the package loads rounds rows differently for different row counts; differences stay at float32 rounding (about
1e-5 of the logit scale, the same as a block chain vs one token at a time). bf16 matmuls on the CPU do not go
through BLAS: there the tree is bit-identical to chains, cache rows and rollback included (`test_bf16_bit_exact`).
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

import cache_compare as cc
import tiny
from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.caches import copy_cache
from dflash_mlx.targets.tree import commit_path, tree_forward, tree_support

# (where the model comes from, kind): every family, and llama with sliding-window layers
FAMILIES = [("cc", k) for k in ("qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text", "gemma4_text", "qwen3_5",
                                "qwen3_5_moe", "qwen3_next")] + [("tiny", k) for k in ("llama", "qwen3", "llama_swa")]
RTOL = 1e-4
PROMPT = 20  # past the windowed families' window (8): trees read a full window


def _target(source: str, kind: str) -> TargetModel:
    model = cc.shared(kind) if source == "cc" else tiny.target(kind)
    return TargetModel(model, [1, len(model.layers) - 1])


def _shapes(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    bushy = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, 17)]  # deep and bushy, n = 16
    return {
        "chain": [-1] + list(range(12)),  # deeper than the window: its oldest ancestors fall out of it
        "star": [-1] + [0] * 8,
        "bushy": bushy,
        "random": [-1] + [int(rng.integers(0, i)) for i in range(1, 11)],
    }


def _path_to(parents: Sequence[int], node: int) -> List[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _close(a: mx.array, b: mx.array, what: str) -> float:
    diff = mx.abs(a - b).max().item()
    scale = max(1.0, mx.abs(b).max().item())
    assert diff <= RTOL * scale, f"{what}: differs by {diff:.3g} (scale {scale:.3g})"
    return diff


def _prefilled(t: TargetModel, tokens: Sequence[int]):
    cache = t.make_cache()
    if tokens:
        t(mx.array([list(tokens)]), cache)
    return cache


def _check_tree(t: TargetModel, cache, ids: List[int], parents: List[int]) -> float:
    """Every node's logits and hidden vs a chain pass of its path on a copy of the cache; the cache untouched."""
    before = [_arrays(c) for c in cache]
    logits, hidden, write = tree_forward(t, mx.array([ids]), parents, cache)
    assert logits.shape == (1, len(ids), cc.VOCAB) and hidden.shape[:2] == (1, len(ids))
    worst = 0.0
    for node in range(len(ids)):
        path = _path_to(parents, node)
        l, h = t(mx.array([[ids[j] for j in path]]), [copy_cache(c) for c in cache])
        worst = max(worst, _close(logits[0, node], l[0, -1], f"logits of node {node}"))
        _close(hidden[0, node], h[0, -1], f"hidden of node {node}")
    after = [_arrays(c) for c in cache]
    same = lambda p, q: p is q if isinstance(p, mx.array) else p == q  # noqa: E731
    assert all(all(same(p, q) for p, q in zip(x, y)) for x, y in zip(before, after)), "tree_forward changed the cache"
    return worst


def _arrays(c):
    if isinstance(c, ArraysCache):
        return (c[0], c[1])
    return (c.keys, c.values, c.offset)


def _assert_caches_close(ours, ref) -> None:
    """`cache_compare.assert_caches_equal`, up to float rounding."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert type(a) is type(b)
        if isinstance(a, ArraysCache):
            _close(a[0], b[0], f"layer {i} conv state")
            _close(a[1], b[1], f"layer {i} recurrent state")
        else:
            assert a.offset == b.offset, f"layer {i}: offset {a.offset} vs {b.offset}"
            for x, y, what in zip(cc.visible_kv(a), cc.visible_kv(b), ("keys", "values")):
                assert x.shape == y.shape, f"layer {i} {what}: {x.shape} vs {y.shape}"
                _close(x, y, f"layer {i} {what}")


def _offset(cache) -> int:
    return next(c.offset for c in cache if not isinstance(c, ArraysCache))


@pytest.mark.parametrize("source,kind", FAMILIES, ids=[k for _, k in FAMILIES])
def test_tree_matches_chains_and_commits(source, kind):
    t = _target(source, kind)
    assert tree_support(t, t.make_cache()) is None
    rng = np.random.default_rng(7)
    prompt = cc.prompt(PROMPT)
    for name, parents in _shapes(len(kind)).items():
        cache = _prefilled(t, prompt)
        committed = list(prompt)
        for pass_no in range(2):  # (3) a second tree pass after a commit
            ids = [int(x) for x in rng.integers(0, cc.VOCAB, len(parents))]
            _check_tree(t, cache, ids, parents)
            _, _, write = tree_forward(t, mx.array([ids]), parents, cache)
            path = _path_to(parents, int(rng.integers(0, len(parents))) if pass_no else len(parents) - 1)
            commit_path(t, cache, write, path)
            committed += [ids[j] for j in path]
            assert _offset(cache) == len(committed), f"{name}: offset after commit"
            fresh = _prefilled(t, committed)
            _assert_caches_close(cache, fresh)
            step = mx.array([[int(rng.integers(0, cc.VOCAB))]])
            _close(t(step, [copy_cache(c) for c in cache])[0], t(step, fresh)[0], f"{name}: step after commit")


@pytest.mark.parametrize("source,kind", [("cc", "qwen3_next"), ("cc", "gpt_oss"), ("tiny", "llama")],
                         ids=["qwen3_next", "gpt_oss", "llama"])
def test_commit_then_rollback(source, kind):
    """A committed path is one chain write: rolling part of it back (GatedDeltaNet record, window) is exact."""
    t = _target(source, kind)
    prompt = cc.prompt(PROMPT, seed=1)
    parents = [-1, 0, 1, 1, 2, 4, 5, 0]
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    cache = _prefilled(t, prompt)
    _, _, write = tree_forward(t, mx.array([ids]), parents, cache)
    path = [0, 1, 2, 4, 5]
    commit_path(t, cache, write, path)
    t.rollback(cache, 2)
    kept = prompt + [ids[j] for j in path[:3]]
    fresh = _prefilled(t, kept)
    _assert_caches_close(cache, fresh)
    step = mx.array([[11]])
    _close(t(step, cache)[0], t(step, fresh)[0], "step after commit and rollback")


def test_tree_on_empty_cache():
    """The root at position 0: fresh KV and GatedDeltaNet caches."""
    for source, kind in (("cc", "qwen3_5"), ("tiny", "qwen3")):
        t = _target(source, kind)
        parents, ids = [-1, 0, 0, 1, 3], [5, 6, 7, 8, 9]
        cache = t.make_cache()
        _check_tree(t, cache, ids, parents)
        _, _, write = tree_forward(t, mx.array([ids]), parents, cache)
        commit_path(t, cache, write, [0, 1, 3, 4])
        _assert_caches_close(cache, _prefilled(t, [5, 6, 8, 9]))


def test_commit_refuses_bad_or_stale_writes():
    t = _target("tiny", "llama")
    cache = _prefilled(t, cc.prompt(10))
    with pytest.raises(DFlashError, match="parents"):
        tree_forward(t, mx.array([[1, 2, 3]]), [-1, 0, 2], cache)
    _, _, write = tree_forward(t, mx.array([[1, 2, 3]]), [-1, 0, 0], cache)
    with pytest.raises(DFlashError, match="path"):
        commit_path(t, cache, write, [0, 1, 2])  # 2 is a sibling of 1, not its child
    commit_path(t, cache, write, [0, 2])
    with pytest.raises(DFlashError, match="changed"):
        commit_path(t, cache, write, [0, 1])  # the cache moved on since the pass


def test_tree_support_reasons():
    llama = _target("tiny", "llama")
    cache = llama.make_cache()
    cache[1] = QuantizedKVCache()
    assert "quantized" in tree_support(llama, cache)
    with pytest.raises(DFlashError, match="quantized"):
        tree_forward(llama, mx.array([[1, 2]]), [-1, 0], cache)
    gpt = _target("cc", "gpt_oss")
    own = make_prompt_cache(gpt.model)  # mlx-lm's ring caches: their rows are not in temporal order
    assert any(type(c) is RotatingKVCache for c in own)
    assert "RotatingKVCache" in tree_support(gpt, own)
    assert tree_support(llama, [KVCache()]) is not None  # one cache for a 4-layer model

    class Stage(TargetModel):  # a pipeline stage's target: its pass sends and gathers around the walk
        stage_aware = True

    assert "pipeline" in tree_support(Stage(llama.model, [1]), llama.make_cache())


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="row-count-independent matmuls: the CPU backend's bf16")
@pytest.mark.parametrize("source,kind", [("tiny", "llama_swa"), ("tiny", "qwen3"), ("cc", "gemma3_text"),
                                         ("cc", "gemma4_text"), ("cc", "qwen3_5")],
                         ids=["llama_swa", "qwen3", "gemma3_text", "gemma4_text", "qwen3_5"])
def test_bf16_bit_exact(source, kind):
    """Same numbers as chains where matmuls round each row alike: logits, hidden, committed caches, rollback."""
    model = cc.build(kind) if source == "cc" else tiny.build_target(kind)
    model.set_dtype(mx.bfloat16)
    t = TargetModel(model, [1, len(model.layers) - 1])
    parents = _shapes(3)["bushy"]
    ids = [int(x) for x in np.random.default_rng(5).integers(0, cc.VOCAB, len(parents))]
    cache = _prefilled(t, cc.prompt(PROMPT))
    logits, hidden, write = tree_forward(t, mx.array([ids]), parents, cache)
    for node in range(len(ids)):
        l, h = t(mx.array([[ids[j] for j in _path_to(parents, node)]]), [copy_cache(c) for c in cache])
        assert mx.array_equal(logits[0, node], l[0, -1]).item() and mx.array_equal(hidden[0, node], h[0, -1]).item()
    path = _path_to(parents, len(ids) - 1)
    chain = [copy_cache(c) for c in cache]
    t(mx.array([[ids[j] for j in path]]), chain)
    commit_path(t, cache, write, path)
    cc.assert_caches_equal(cache, chain)
    t.rollback(cache, 2)
    t.rollback(chain, 2)
    cc.assert_caches_equal(cache, chain)
