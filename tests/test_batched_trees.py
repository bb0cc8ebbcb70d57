"""Draft trees in batched passes (`decode.batching`): members whose planner drafts trees verify them in the same
round as the others' chains, and every member's output is still the target's alone: greedy equals mlx-lm's greedy
on every family, seeded sampling follows the target's distribution, and a member closed with a pass it never saw
keeps exact caches."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np
import pytest

import tiny
from cache_compare import CONFIGS, VOCAB, WINDOW, prompt, shared
from dflash_mlx.decode.acceptance import SamplingAcceptor
from dflash_mlx.decode.batching import Batch, BatchedGeneration
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel
from test_batching import drive

MAX_TOKENS = 18
# Dense, sliding-window, hybrid GatedDeltaNet, MoE, MLA and shared-KV (a walk of its own: whole passes).
FAMILIES = ("qwen3", "llama_swa", "qwen3_5", "qwen3_moe", "deepseek_v3", "gemma4_text")


class KeyedRunnerUp(OracleDrafter):
    """Several requests' continuations at once (the one whose token at the block's start is the block's first token
    proposes); at every position p with p % every == 0 the true token is ranked second (first: a wrong one), so a
    chain stops there while a tree with a second child goes on."""

    def __init__(self, sequences: Sequence[Sequence[int]], block_size: int, every: int = 3):
        super().__init__([], VOCAB, block_size, VOCAB - 1)
        self.sequences, self.every = [list(s) for s in sequences], every

    def __call__(self, block_ids, cache):
        start, block, last = cache[0].offset, block_ids.shape[1], int(block_ids[0, 0].item())
        seq = next((s for s in self.sequences if len(s) > start and s[start] == last), [])
        rows = []
        for p in range(start + 1, start + block):
            tok = seq[p] if p < len(seq) else 0
            row = np.full((VOCAB,), -30.0, np.float32)
            if p % self.every == 0:
                row[(tok + 1) % VOCAB], row[tok] = 30.0, 29.0
            else:
                row[tok], row[(tok + 7) % VOCAB] = 30.0, 29.0
            rows.append(row)
        return mx.array(np.stack(rows))[None]


def _case(kind: str):
    from mlx_lm.generate import generate_step

    model = shared(kind) if kind in CONFIGS else tiny.target(kind)
    lengths = (WINDOW + 3, 2 * WINDOW + 1, 7)  # some longer than the sliding window
    prompts = [prompt(n, seed=n) for n in lengths]
    refs = [[int(t) for t, _ in generate_step(mx.array(p, dtype=mx.int32), model, max_tokens=MAX_TOKENS)]
            for p in prompts]
    return model, prompts, refs


@pytest.mark.parametrize("kind", FAMILIES)
def test_batched_trees_equal_greedy(kind):
    """Three members, two drafting trees (fixed budgets) and one chains, joining late: each equals mlx-lm's greedy,
    tree passes really ran beside chain passes, and trees accepted past the drafter's wrong first choices."""
    model, prompts, refs = _case(kind)
    t = TargetModel(model)
    batch = Batch(t, KeyedRunnerUp([p + r for p, r in zip(prompts, refs)], block_size=4))
    budgets = (10, None, 3)  # DDTree ranks the runner-up at depth 3 tenth
    gens = {i: BatchedGeneration(batch, p, max_tokens=MAX_TOKENS, width=4, tree_budget=b)
            for i, (p, b) in enumerate(zip(prompts, budgets))}
    accepted = {i: [] for i in gens}
    original = {i: g._record for i, g in gens.items()}
    for i, g in gens.items():  # the accepted drafts of each pass, as the generation counts them
        g._record = (lambda i: lambda acc, width, source: (accepted[i].append(acc), original[i](acc, width, source)))(i)
    out = drive(gens, join_after={2: 1})
    assert [out[i] for i in range(3)] == refs, kind
    assert batch.tree_passes > 0 and max(batch.sizes) >= 2
    # The chain member stops at every spoiled position (at most 2 drafts of 3); a tree of 10 reaches past them.
    assert max(accepted[1]) <= 2 and max(accepted[0]) == 3
    assert not batch.members


def test_batched_auto_trees_equal_greedy_and_learn():
    """`tree_budget="auto"` in a batch: lossless, and the tree arms are measured (the planner tried them)."""
    model, prompts, refs = _case("qwen3_5")
    t = TargetModel(model)
    batch = Batch(t, KeyedRunnerUp([p + r for p, r in zip(prompts, refs)], block_size=8, every=4))
    gens = {i: BatchedGeneration(batch, p, max_tokens=MAX_TOKENS, tree_budget="auto", lookup=False)
            for i, p in enumerate(prompts)}
    out = drive(gens)
    assert [out[i] for i in range(3)] == refs
    assert batch.tree_passes > 0
    tried = {arm for g in gens.values() for arms in g.planner.trees.contexts.values()
             for arm, n in arms.tries.items() if n and arm is not None}
    assert tried  # at least one tree budget ran and was measured


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_tree_member_closed_with_an_unyielded_pass_keeps_exact_caches(kind):
    """A tree member whose next pass ran for the batch but was never yielded is closed: its caches hold exactly the
    tokens it yielded, so the next turn on them is exact."""
    model, prompts, refs = _case(kind)
    t = TargetModel(model)
    batch = Batch(t, KeyedRunnerUp([p + r for p, r in zip(prompts, refs)], block_size=4))
    state = DecodeState.fresh(t, batch.drafter)
    leaver = BatchedGeneration(batch, prompts[0], max_tokens=MAX_TOKENS, width=4, tree_budget=6, state=state)
    other = BatchedGeneration(batch, prompts[1], max_tokens=MAX_TOKENS, width=4, tree_budget=3)
    a, b = iter(leaver), iter(other)
    seen = list(next(a).tokens)
    next(b)
    seen += next(a).tokens  # pass 1, run for both
    next(b)  # pass 2 runs for both: the leaver's is never yielded
    leaver.close()
    assert batch.tree_passes > 0
    assert seen == refs[0][: len(seen)]
    # The caches hold exactly the prompt and `seen` but the newest token (slot 0 of the next block).
    nxt = t(mx.array([[seen[-1]]]), state.target_cache)[0]
    assert int(mx.argmax(nxt[0, -1]).item()) == refs[0][len(seen)]
    other.close()


# -- sampling: the exact-distribution test, each sample drawn as a member of a two-member batch ------------------
def test_batched_sampled_trees_follow_the_target_distribution():
    from test_sampling import (ALPHA, E2E_BLOCK, E2E_VOCAB, FILTERS, PROMPT, chi2_pvalue, exact_target_joint,
                               joint_counts)

    model = tiny.build_target("llama", seed=3, num_hidden_layers=1, vocab_size=E2E_VOCAB)
    drafter, t = tiny.make_drafter(model, block_size=E2E_BLOCK, vocab_size=E2E_VOCAB, mask_token_id=E2E_VOCAB - 1,
                                   num_hidden_layers=1, target_layer_ids=[0])
    params = FILTERS["plain"]
    seqs, trees = [], 0
    for pair in range(200):
        batch = Batch(t, drafter)
        gens = {i: BatchedGeneration(batch, PROMPT, max_tokens=4, tree_budget=4,
                                     acceptor=SamplingAcceptor(params, seed=2 * pair + i)) for i in range(2)}
        out = drive(gens)
        seqs += [out[0][:3], out[1][:3]]
        trees += batch.tree_passes
    assert trees > 0
    joint = exact_target_joint(model, PROMPT, params)
    assert chi2_pvalue(joint_counts(np.array(seqs), E2E_VOCAB), joint) > ALPHA


def test_auto_trees_under_a_rank_coordinator_compare_arms_on_the_fixed_cost_model():
    """Ranks of one distributed generation must choose the same tree budgets: with a coordinator installed, "auto"
    compares its arms on `nominal_cost`, never on the rank's own clock."""
    from dflash_mlx.decode.planner import tree_chooser
    from dflash_mlx.decode.width import install_coordinator, nominal_cost

    assert tree_chooser("auto").cost is None
    install_coordinator(lambda policy: policy)
    try:
        assert tree_chooser("auto").cost is nominal_cost
    finally:
        install_coordinator(None)
    assert tree_chooser("auto").cost is None
