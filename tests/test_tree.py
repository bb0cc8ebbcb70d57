"""Draft trees: DDTree construction (parity with the reference implementation's outputs, stored in
tests/fixtures/ddtree by benchmarks/ddtree_reference.py), prompt lookup with branches, and verification.

Sampled verification is checked as test_sampling.py checks chains: a chi-square goodness-of-fit test of the first
three committed tokens against the target's exact joint distribution, on a tiny vocabulary, with trees where
siblings really are rejected (several children per node, point-mass and sampled nodes mixed, a sampled node's row
depending on its parent's token), vectorized over many trees in one `verify_tree` call; negative controls with a
wrong residual must fail it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler
from scipy import stats

from test_sampling import ALPHA, chi2_pvalue, joint_counts, reference_probs
from dflash_mlx.decode import tree
from dflash_mlx.decode.acceptance import GreedyAcceptor, MatchAcceptor, SamplingAcceptor
from dflash_mlx.decode.lookup import LookupIndex
from dflash_mlx.decode.proposal import TreeProposal
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.decode.tree import _top_k, build_ddtree, lookup_tree, propose_tree, verify_tree

CASES = json.loads((Path(__file__).parent / "fixtures" / "ddtree" / "cases.json").read_text())


# -- building --------------------------------------------------------------------------------------------------------
def _normalized(logits) -> mx.array:
    """Log-probabilities as the reference implementation computes them from logits (MLX, float32)."""
    x = mx.array(np.asarray(logits, dtype=np.float32))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ddtree_matches_the_reference(case):
    logq = _normalized(case["logits"])
    assert build_ddtree(logq, case["budget"]) == (case["tokens"], case["parents"])
    assert build_ddtree(np.array(logq), case["budget"]) == (case["tokens"], case["parents"])
    # Block-slot invariants: parents precede children, at most `budget` nodes, siblings distinct.
    tokens, parents = case["tokens"], case["parents"]
    assert len(tokens) <= case["budget"] and all(p <= i for i, p in enumerate(parents))
    assert len(set(zip(parents, tokens))) == len(tokens)


def test_top_k_breaks_ties_like_a_stable_sort():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 3, size=(50, 17)).astype(np.float32)
    for k in (1, 3, 8, 17, 40):
        ids, lps = _top_k(rows, k)
        ref = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
        assert ids == ref.tolist() and lps == np.take_along_axis(rows, ref, -1).tolist()


def test_ddtree_edges():
    assert build_ddtree(np.zeros((0, 5)), 4) == ([], [])
    assert build_ddtree(np.zeros((3, 5)), 0) == ([], [])
    # A sharp drafter gives its chain first: argmax at every depth, each node the child of the one before.
    logq = np.log(np.full((4, 6), 0.01) + 0.94 * np.eye(6)[[3, 1, 4, 1]])
    tokens, parents = build_ddtree(logq, 4)
    assert tokens == [3, 1, 4, 1] and parents == [0, 1, 2, 3]


def test_propose_tree():
    logits = mx.array(np.random.default_rng(1).standard_normal((3, 9)).astype(np.float32))
    greedy = propose_tree(logits, GreedyAcceptor(), 7)
    assert isinstance(greedy, TreeProposal) and greedy.point_mass and greedy.width == 8
    assert (greedy.tokens.tolist(), list(greedy.parents)) == build_ddtree(_normalized(logits), 7)
    # A sampling acceptor ranks by the distribution it samples from; filtered tokens never enter the tree.
    params = SamplingParams(temp=0.7, top_k=2)
    sampled = propose_tree(logits, SamplingAcceptor(params, seed=0), 50)
    top2 = np.argsort(-np.array(logits), axis=-1)[:, :2]
    assert len(sampled.parents) == 2 + 4 + 8
    assert all(t in top2[d - 1] for t, d in zip(sampled.tokens.tolist(), sampled.depths[1:]))
    # Logits processors make every node's row depend on its path: no tree, the caller drafts a chain.
    penalized = SamplingAcceptor(params, [lambda tokens, x: x], seed=0)
    assert propose_tree(logits, penalized, 5) is None


def test_a_tree_over_a_drafters_own_vocabulary_is_the_full_vocabularys():
    """A reduced draft vocabulary (`columns`: its token ids, here in no particular order, as a frequency-sorted
    vocabulary is) ranked on its own gives the tree the full-vocabulary logits give, ties by lower token id."""
    rng = np.random.default_rng(3)
    vocab, n, depth = 200, 50, 6
    for trial in range(12):
        columns = rng.choice(vocab, n, replace=False)
        draft = rng.standard_normal((depth, n)).astype(np.float32)
        draft[:, 5] = draft[:, 7]  # ties at every depth: the lower token id ranks first in both
        draft[2, 10:14] = draft[2, 9]
        full = np.full((depth, vocab), -1e9, np.float32)
        full[:, columns] = draft
        for budget in (1, 4, 15, 40):
            whole = propose_tree(mx.array(full), GreedyAcceptor(), budget)
            own = propose_tree(mx.array(draft), GreedyAcceptor(), budget, mx.array(columns))
            assert own.tokens.tolist() == whole.tokens.tolist() and own.parents == whole.parents, (trial, budget)
    # All of a row at once (k >= N) and partitioned (k < N) break ties alike.
    row = np.array([[0.5, 0.5, 0.2, 0.5]], np.float32)
    columns = np.array([9, 3, 1, 7])
    assert _top_k(row, 4, columns)[0] == [[3, 7, 9, 1]] and _top_k(row, 2, columns)[0] == [[3, 7]]


# -- prompt lookup with branches -------------------------------------------------------------------------------------
def test_lookup_tree_single_occurrence_is_the_chain():
    index = LookupIndex(min_n=2, max_n=4)
    index.extend([1, 2, 3, 9, 8, 7, 6, 5, 1, 2, 3])
    chain = index.propose(4)
    proposal = lookup_tree(index, 5, branches=3)
    assert proposal.tokens.tolist() == chain.tokens and proposal.parents == (0, 1, 2, 3)
    assert lookup_tree(index, 1, 3) is None and lookup_tree(index, 5, 0) is None
    index.extend([77, 78])
    assert lookup_tree(index, 5, 3) is None


def test_lookup_tree_merges_occurrences_into_a_trie():
    index = LookupIndex(min_n=2, max_n=3)
    # "0 4 5" was followed by 6 7 8, then by 6 9, then (most recently) by 1 2.
    index.extend([0, 4, 5, 6, 7, 8, 0, 4, 5, 6, 9, 0, 0, 4, 5, 1, 2, 0, 4, 5])
    proposal = lookup_tree(index, 8, branches=3)
    # Grown a depth at a time, the most recent continuation first among siblings; "6" is shared.
    assert proposal.tokens.tolist() == [1, 6, 2, 9, 7, 0, 0]
    assert proposal.parents == (0, 0, 1, 2, 2, 3, 4)
    assert lookup_tree(index, 8, branches=1).tokens.tolist() == index.propose(7).tokens
    small = lookup_tree(index, 4, branches=3)  # the budget caps the trie
    assert small.tokens.tolist() == [1, 6, 2] and small.parents == (0, 0, 1)


# -- greedy verification ---------------------------------------------------------------------------------------------
# slots: 1:2 2:3 (children of the root), 3:4 (of 1), 4:1 5:5 (of 2), 6:0 (of 4)
HAND = TreeProposal(mx.array([2, 3, 4, 1, 5, 0], dtype=mx.int32), point_mass=True, parents=(0, 0, 1, 2, 2, 4))


def _rows(argmaxes, vocab=6):
    return mx.array(np.eye(vocab, dtype=np.float32)[argmaxes] * 5.0)


@pytest.mark.parametrize("argmaxes, acc, path, fix", [
    ([3, 0, 5, 0, 0, 2, 0], 2, [2, 5, 0], 2),  # the second root child, then its second child, then a correction
    ([0, 0, 0, 0, 0, 0, 0], 0, [0, 0, 0], 0),  # no child matches the root's choice
    ([2, 4, 0, 3, 0, 0, 0], 2, [1, 3, 0], 3),  # a leaf: its row gives the bonus
    ([3, 0, 1, 0, 0, 0, 5], 3, [2, 4, 6], 5),  # down to the deepest leaf
])
def test_greedy_follows_the_argmax(argmaxes, acc, path, fix):
    for acceptor in (GreedyAcceptor(), MatchAcceptor(lambda lp: mx.argmax(lp, axis=-1))):
        a, p, f = verify_tree(acceptor, HAND, _rows(argmaxes))
        assert (a.item(), p.tolist(), f.item()) == (acc, path, fix)
    # Batched: one tree shape, every row its own target.
    rows = mx.stack([_rows(argmaxes), _rows([0] * 7)])
    a, p, f = verify_tree(GreedyAcceptor(), replace(HAND, tokens=mx.stack([HAND.tokens] * 2)), rows)
    assert a.tolist() == [acc, 0] and p.tolist() == [path, [0, 0, 0]] and f.tolist() == [fix, 0]


def test_an_empty_tree_is_a_plain_step():
    empty = TreeProposal(mx.zeros((0,), dtype=mx.int32), parents=())
    a, p, f = verify_tree(GreedyAcceptor(), empty, _rows([4]))
    assert (a.item(), p.shape, f.item()) == (0, (0,), 4)
    a, p, f = verify_tree(SamplingAcceptor(SamplingParams(temp=1.0), seed=0), empty, _rows([4]) * 10)
    assert (a.item(), p.shape, f.item()) == (0, (0,), 4)
    with pytest.raises(ValueError):
        verify_tree(GreedyAcceptor(), replace(HAND, parents=(0, 2, 1, 2, 2, 4)), _rows([0] * 7))


def test_greedy_processors_see_each_nodes_own_path():
    """With a processor banning the previous token, a row's argmax depends on the path to its node."""
    def ban_last(tokens, logits):
        return logits if tokens.size == 0 else mx.where(mx.arange(logits.shape[-1]) == tokens[-1], -1e9, logits)
    acceptor = SamplingAcceptor(SamplingParams(), [ban_last], seed=0)
    acceptor.observe([3])
    rows = mx.array(np.tile(np.array([0, 1, 2, 6, 5, 4], dtype=np.float32), (7, 1)))
    # root: 3 banned -> 4 is argmax, no child; the fix is 4.
    a, p, f = verify_tree(acceptor, HAND, rows)
    assert (a.item(), f.item()) == (0, 4)
    acceptor.observe([0])  # root token 0: 3 wins -> slot 2; after 3 -> 4 (no child has 4; slot 4 is 1) -> fix 4
    a, p, f = verify_tree(acceptor, HAND, rows)
    assert (a.item(), p.tolist(), f.item()) == (1, [2, 0, 0], 4)


def test_greedy_chain_equals_the_chain_verify():
    rng = np.random.default_rng(3)
    for _ in range(20):
        draft = mx.array(rng.integers(0, 4, 5).astype(np.int32))
        logits = mx.array(rng.standard_normal((6, 4)).astype(np.float32))
        acc, choice = GreedyAcceptor().verify(GreedyAcceptor().propose_tokens(draft), logits)
        a, p, f = verify_tree(GreedyAcceptor(), TreeProposal(draft, parents=(0, 1, 2, 3, 4)), logits)
        assert a.item() == acc.item() and f.item() == choice[acc].item()
        assert p.tolist()[: a.item()] == list(range(1, a.item() + 1))


# -- sampled verification: exact distributions -----------------------------------------------------------------------
V, N = 5, 20000
PARAMS = {"plain": SamplingParams(temp=1.0), "filtered": SamplingParams(temp=0.8, top_k=3, top_p=0.9)}


class World:
    """A synthetic target over V tokens: logits of the next token after every path of up to three tokens."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.t = [rng.standard_normal((V,) * (d + 1)) * 1.5 for d in range(4)]
        self.rng = rng

    def rows(self, tokens: np.ndarray, parents) -> np.ndarray:
        """Target logits [N, n+1, V] at every node of trees with tokens [N, n]."""
        paths, rows = [[]], [np.broadcast_to(self.t[0], (tokens.shape[0], V))]
        for i, p in enumerate(parents):
            paths.append(paths[p] + [i])
            rows.append(self.t[len(paths[-1])][tuple(tokens[:, j] for j in paths[-1])])
        return np.stack(rows, axis=1).astype(np.float32)

    def joint(self, params) -> np.ndarray:
        p0, p1, p2 = (reference_probs(t, params) for t in self.t[:3])
        return p0[:, None, None] * p1[:, :, None] * p2

    def complete(self, tokens, parents, acc, path, fix, params, seed) -> np.ndarray:
        """The first three committed tokens: the accepted path, the fix, then plain target sampling."""
        n = tokens.shape[0]
        ext = np.concatenate([np.zeros((n, 1), dtype=tokens.dtype), tokens], axis=1)
        seq = np.zeros((n, 3), dtype=np.int64)
        for col in range(3):
            from_path = np.take_along_axis(ext, path[:, col : col + 1], 1)[:, 0] if col < path.shape[1] else fix
            seq[:, col] = np.where(acc > col, from_path, np.where(acc == col, fix, 0))
        rng = np.random.default_rng(seed)
        for col in (1, 2):
            probs = reference_probs(self.t[col][tuple(seq[:, j] for j in range(col))], params)
            cdf = np.cumsum(probs, axis=-1)
            drawn = np.minimum((cdf < rng.random((n, 1)) * cdf[:, -1:]).sum(-1), V - 1)
            seq[:, col] = np.where(acc < col, drawn, seq[:, col])
        return seq


def _draw(rng, probs: np.ndarray) -> np.ndarray:
    """One token per row of probs [N, V]."""
    return (probs.cumsum(-1) < rng.random((probs.shape[0], 1))).sum(-1).clip(0, V - 1)


# Mixed tree: ("fix", token) point masses, ("q", name) drawn from a fixed row, ("q|parent", name) from a row
# chosen by the parent's token. Slot i+1 = MIXED[i]; root children 1-4 (2 and 3 i.i.d. from one row), depth 3 at 8, 9.
MIXED = [(0, ("fix", 2)), (0, ("q", "a")), (0, ("q", "a")), (0, ("fix", 0)), (1, ("q", "b")), (1, ("fix", 4)),
         (2, ("q|parent", "c")), (5, ("q|parent", "d")), (7, ("fix", 1))]


def _mixed_trees(world: World, n: int, seed: int):
    """Tokens [n, 9] and log q [n, 9, V] of independent draws of the MIXED tree."""
    rng = np.random.default_rng(seed)
    q = {"a": reference_probs(rng.standard_normal(V) * 1.5, SamplingParams(temp=1.0, top_k=3)),
         "b": reference_probs(rng.standard_normal(V), SamplingParams(temp=1.0)),
         "c": reference_probs(rng.standard_normal((V, V)) * 2, SamplingParams(temp=1.0)),
         "d": reference_probs(rng.standard_normal((V, V)), SamplingParams(temp=0.5))}
    tokens, rows = np.zeros((n, len(MIXED)), dtype=np.int64), []
    for i, (parent, (kind, what)) in enumerate(MIXED):
        if kind == "fix":
            row = np.broadcast_to(np.eye(V)[what], (n, V))
        else:
            row = np.broadcast_to(q[what], (n, V)) if kind == "q" else q[what][tokens[:, parent - 1]]
        tokens[:, i] = what if kind == "fix" else _draw(rng, row)
        rows.append(row)
    with np.errstate(divide="ignore"):
        logq = np.log(np.stack(rows, axis=1)).astype(np.float32)
    return tokens, logq


def _run(world, acceptor, tokens, logq, parents, params, seed):
    proposal = TreeProposal(mx.array(tokens.astype(np.int32)), None if logq is None else mx.array(logq),
                            point_mass=logq is None, parents=tuple(parents))
    acc, path, fix = verify_tree(acceptor, proposal, mx.array(world.rows(tokens, parents)))
    acc, path, fix = np.array(acc), np.array(path), np.array(fix)
    return world.complete(tokens, parents, acc, path, fix, params, seed), acc, path


@pytest.mark.parametrize("name", list(PARAMS))
def test_sampled_mixed_tree_is_lossless(name):
    params = PARAMS[name]
    world = World(seed=1 + list(PARAMS).index(name))
    parents = [p for p, _ in MIXED]
    tokens, logq = _mixed_trees(world, N, seed=2)
    seq, acc, path = _run(world, SamplingAcceptor(params, seed=3), tokens, logq, parents, params, seed=4)
    p_value = chi2_pvalue(joint_counts(seq, V), world.joint(params))
    print(f"mixed tree {name}: p = {p_value:.3g}, mean acc {acc.mean():.2f}")
    assert p_value > ALPHA
    # Siblings were tried past the first (the third root child was kept after two rejections), and paths reached
    # depth 3. (A fixed token outside the target's filtered support, or used up by the residual, is never kept.)
    kept = set(path[:, 0][acc > 0].tolist())
    assert len(kept) >= 2 and max(kept) >= 3 and (acc == 3).any()


@pytest.mark.parametrize("wrong", ["resample_from_p", "unnormalized"])
def test_negative_control_detects_a_wrong_residual(monkeypatch, wrong):
    params = PARAMS["plain"]
    world = World(seed=1)
    if wrong == "resample_from_p":
        monkeypatch.setattr(tree, "_residual", lambda r, mass, q: r)
    else:  # subtract q from the unnormalized residual
        monkeypatch.setattr(tree, "_residual", lambda r, mass, q: mx.maximum(r - q, 0.0))
    parents = [p for p, _ in MIXED]
    tokens, logq = _mixed_trees(world, N, seed=2)
    seq, _, _ = _run(world, SamplingAcceptor(params, seed=3), tokens, logq, parents, params, seed=4)
    p_value = chi2_pvalue(joint_counts(seq, V), world.joint(params))
    print(f"negative control {wrong}: p = {p_value:.3g}")
    assert p_value < 1e-6


@pytest.mark.parametrize("name", list(PARAMS))
def test_sampled_ddtree_from_drafter_logits_is_lossless(name):
    """The DFlash tree: point masses on the drafter's top choices under its own filtered, tempered distribution."""
    params = PARAMS[name]
    world = World(seed=11 + list(PARAMS).index(name))
    acceptor = SamplingAcceptor(params, seed=5)
    draft_logits = mx.array((world.rng.standard_normal((3, V)) * 1.5).astype(np.float32))
    proposal = propose_tree(draft_logits, acceptor, 12)
    assert max(np.bincount(proposal.parents)) >= 2 and max(proposal.depths) >= 2
    tokens = np.broadcast_to(np.array(proposal.tokens), (N, len(proposal.parents)))
    seq, acc, _ = _run(world, acceptor, tokens, None, proposal.parents, params, seed=6)
    p_value = chi2_pvalue(joint_counts(seq, V), world.joint(params))
    print(f"ddtree {name}: p = {p_value:.3g}, mean acc {acc.mean():.2f}")
    assert p_value > ALPHA


def test_match_acceptor_tree_is_lossless():
    params = PARAMS["filtered"]
    world = World(seed=21)
    mx.random.seed(7)
    sampler = make_sampler(params.temp, top_p=params.top_p, top_k=params.top_k)
    proposal = propose_tree(mx.array(world.rng.standard_normal((3, V)).astype(np.float32)), GreedyAcceptor(), 10)
    tokens = np.broadcast_to(np.array(proposal.tokens), (N, len(proposal.parents)))
    seq, _, _ = _run(world, MatchAcceptor(sampler), tokens, None, proposal.parents, params, seed=8)
    p_value = chi2_pvalue(joint_counts(seq, V), world.joint(params))
    print(f"match acceptor: p = {p_value:.3g}")
    assert p_value > ALPHA


def test_sampled_chain_has_the_chain_verify_law():
    """A chain through `verify_tree` accepts as often as the acceptor's own verify, draft for draft."""
    params = PARAMS["filtered"]
    world = World(seed=31)
    draft_logits = mx.array(np.broadcast_to(world.rng.standard_normal((2, V)), (N, 2, V)).astype(np.float32))
    proposal = SamplingAcceptor(params, seed=9).propose(draft_logits)
    tokens = np.array(proposal.tokens)
    rows = mx.array(world.rows(tokens, (0, 1)))
    chain_acc, _ = SamplingAcceptor(params, seed=10).verify(proposal, rows)
    tree_proposal = TreeProposal(proposal.tokens, proposal.logq, parents=(0, 1))
    tree_acc, path, _ = verify_tree(SamplingAcceptor(params, seed=11), tree_proposal, rows)
    table = np.stack([np.bincount(np.array(a), minlength=3) for a in (chain_acc, tree_acc)])
    p_value = stats.chi2_contingency(table)[1]
    print(f"chain law: p = {p_value:.3g}, counts {table.tolist()}")
    assert p_value > ALPHA and (np.array(path)[:, 0] == np.where(np.array(tree_acc) > 0, 1, 0)).all()
    # Fixed drafts (point masses, one draw per row in the tree) against the chain's accept-then-residual rule.
    fixed = mx.array(np.random.default_rng(12).integers(0, V, (N, 2)).astype(np.int32))
    rows = mx.array(world.rows(np.array(fixed), (0, 1)))
    chain_acc, _ = SamplingAcceptor(params, seed=13).verify(SamplingAcceptor(params).propose_tokens(fixed), rows)
    tree_acc, _, _ = verify_tree(SamplingAcceptor(params, seed=14), TreeProposal(fixed, point_mass=True, parents=(0, 1)),
                                 rows)
    table = np.stack([np.bincount(np.array(a), minlength=3) for a in (chain_acc, tree_acc)])
    p_value = stats.chi2_contingency(table)[1]
    print(f"point-mass chain law: p = {p_value:.3g}, counts {table.tolist()}")
    assert p_value > ALPHA


def test_seed_reproduces_a_sampled_verify():
    world = World(seed=1)
    parents = [p for p, _ in MIXED]
    tokens, logq = _mixed_trees(world, 200, seed=2)
    runs = [_run(world, SamplingAcceptor(PARAMS["plain"], seed=s), tokens, logq, parents, PARAMS["plain"], 0)[0]
            for s in (5, 5, 6)]
    assert (runs[0] == runs[1]).all() and (runs[0] != runs[2]).any()
