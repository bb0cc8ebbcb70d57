"""Draft trees end to end: greedy DFlash with DDTree passes (`tree_budget`) equals mlx-lm's own greedy decoding on
every target family, at several budgets and block sizes, with siblings actually accepted; seeded sampling
reproduces; a batch keeps each member's budget; an unsupported target verifies chains."""

from __future__ import annotations

import functools
from typing import List, Sequence

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import tiny
from cache_compare import CONFIGS, VOCAB, WINDOW, prompt, shared
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.decode.proposal import TreeProposal
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel

MAX_TOKENS = 24
# Hybrid GatedDeltaNet, MoE, sliding-window (gpt_oss, gemma3, llama_swa), MLA, shared-KV (gemma4) and dense.
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text", "gemma4_text", "qwen3_moe",
            "deepseek_v3", "llama", "qwen2", "qwen3", "llama_swa")


def model(kind: str):
    return shared(kind) if kind in CONFIGS else tiny.target(kind)
LENGTH = 3 * WINDOW - 1  # longer than the sliding window


@functools.lru_cache(maxsize=None)
def greedy(kind: str, length: int) -> List[int]:
    ids = mx.array(prompt(length, seed=length), dtype=mx.int32)
    return [int(t) for t, _ in generate_step(ids, model(kind), max_tokens=MAX_TOKENS)]


class RunnerUpOracle(OracleDrafter):
    """Knows the continuation but ranks it second at every position p with p % every == 0 (first: a wrong token),
    so a chain stops there while a tree with a second child per level goes on."""

    def __init__(self, sequence: Sequence[int], block_size: int, every: int):
        super().__init__(sequence, VOCAB, block_size, VOCAB - 1)
        self.every = every

    def __call__(self, block_ids, cache):
        start, block = cache[0].offset, block_ids.shape[1]
        rows = []
        for p in range(start + 1, start + block):
            tok = self.sequence[p] if p < len(self.sequence) else 0
            row = mx.full((VOCAB,), -30.0)
            if p % self.every == 0:
                row[(tok + 1) % VOCAB] = 30.0
                row[tok] = 29.0
            else:
                row[tok] = 30.0
                row[(tok + 7) % VOCAB] = 29.0
            rows.append(row)
        return mx.stack(rows)[None]


def run(t, ids, drafter, **options):
    tokens, passes = [], []
    for p in dflash_generate_step(mx.array(list(ids), dtype=mx.int32), t, drafter, max_tokens=MAX_TOKENS,
                                  **options):
        tokens += p.tokens
        passes.append(p)
    return tokens, passes[1:]


@pytest.mark.parametrize("kind", FAMILIES)
def test_tree_passes_are_lossless(kind):
    ref = greedy(kind, LENGTH)
    ids = prompt(LENGTH, seed=LENGTH)
    t = TargetModel(model(kind))
    for block_size, budget in ((4, 1), (4, 6), (8, 3), (8, 16)):
        drafter = RunnerUpOracle(ids + ref, block_size, every=3)
        out, passes = run(t, ids, drafter, width=block_size, tree_budget=budget)
        assert out == ref, (kind, block_size, budget)
        assert all(p.width <= budget + 1 for p in passes)
    # A budget that reaches the runner-up at depth 3 (DDTree ranks it 10th) accepts past every spoiled position,
    # where the chain stops before it.
    out, passes = run(t, ids, RunnerUpOracle(ids + ref, 4, every=3), width=4, tree_budget=10)
    chain_out, chain = run(t, ids, RunnerUpOracle(ids + ref, 4, every=3), width=4)
    assert out == chain_out == ref
    assert [p.accepted for p in passes[1:-1]] == [3] * (len(passes) - 2)
    assert max(p.accepted for p in chain) == 2 and len(passes) < len(chain)


def test_tree_budget_auto_is_lossless_and_tries_every_arm():
    kind = "qwen3_5"
    ref = greedy(kind, LENGTH)
    ids = prompt(LENGTH, seed=LENGTH)
    t = TargetModel(model(kind))
    out, passes = run(t, ids, RunnerUpOracle(ids + ref, 8, every=4), tree_budget="auto")
    assert out == ref
    assert {p.width for p in passes} >= {4, 8, 16}  # trees of budget 3, 7 and 15 ran (16 rows: only a tree)


class BlockRecorder(RunnerUpOracle):
    """Also records the width of every block it drafts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks: List[int] = []

    def __call__(self, block_ids, cache):
        self.blocks.append(block_ids.shape[1])
        return super().__call__(block_ids, cache)


def test_a_tree_drafts_no_deeper_than_its_budget():
    # A tree of B nodes is at most B deep, so the drafter drafts B + 1 slots, not its whole block (it costs less).
    kind = "qwen3"
    ref = greedy(kind, LENGTH)
    ids = prompt(LENGTH, seed=LENGTH)
    drafter = BlockRecorder(ids + ref, 8, every=3)
    out, passes = run(TargetModel(model(kind)), ids, drafter, tree_budget=3)
    assert out == ref
    assert 4 in {p.width for p in passes} and max(p.accepted for p in passes) >= 2
    assert drafter.blocks and max(drafter.blocks) == 4


def test_seeded_sampling_with_trees_reproduces():
    from dflash_mlx.decode.acceptance import make_acceptor
    kind = "qwen3_moe"
    ids = prompt(LENGTH, seed=LENGTH)
    t = TargetModel(model(kind))
    ref = greedy(kind, LENGTH)
    outs = []
    for _ in range(2):
        acceptor = make_acceptor(temp=0.8, seed=3)
        out, passes = run(t, ids, RunnerUpOracle(ids + ref, 4, every=3), width=4, tree_budget=6, acceptor=acceptor)
        outs.append(out)
    assert outs[0] == outs[1]


def test_proposal_is_a_tree():
    from dflash_mlx.decode.acceptance import GreedyAcceptor
    from dflash_mlx.decode.tree import propose_tree
    logits = mx.zeros((3, VOCAB))
    logits[:, 5] = 3.0
    logits[:, 6] = 2.0
    proposal = propose_tree(logits, GreedyAcceptor(), 4)
    assert isinstance(proposal, TreeProposal) and proposal.width == 5
    assert all(p <= i for i, p in enumerate(proposal.parents))


def test_lookup_trees_are_lossless():
    from dflash_mlx.decode.generation import Generation
    from dflash_mlx.decode.lookup import LookupIndex
    from dflash_mlx.decode.proposers.lookup import LookupProposer
    from dflash_mlx.decode.state import DecodeState

    # Branches: the suffix [1, 2] occurred twice before, followed by 3 and by 7.
    index = LookupIndex()
    index.extend([1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 1, 2])
    tree = LookupProposer(index).propose_tree(None, None, 3, 4, None)
    assert isinstance(tree, TreeProposal) and sorted(tree.tokens.tolist()[:2]) == [3, 7]
    for kind in ("qwen3_5", "gpt_oss", "qwen3_moe"):
        ids = prompt(LENGTH, seed=LENGTH)
        t = TargetModel(model(kind))
        ref = greedy(kind, LENGTH)
        out, sources = [], set()
        with Generation(t, None, ids, max_tokens=MAX_TOKENS, lookup=True, tree_budget=6) as generation:
            for p in generation:
                out += p.tokens
                sources.add(p.source)
        assert out == ref, kind


def test_tree_budget_takes_the_fastest_arm_and_keeps_measuring():
    from dflash_mlx.decode.budget import CHAIN, TreeBudget

    speed = {CHAIN: 2.0, 3: 3.0, 7: 2.5, 15: 1.0}  # tokens per second of each arm
    chooser = TreeBudget(warmup=2, explore_every=24)
    chosen = []
    for _ in range(200):
        arm = chooser.choose()
        chosen.append(arm)
        chooser.record(arm, 3, 3 / speed[arm], 1 + (arm or 0))
    assert chosen[:8] == [CHAIN, CHAIN, 3, 3, 7, 7, 15, 15]  # every arm measured first
    late = chosen[100:]
    assert late.count(3) >= len(late) - len(late) // 24 - 1  # the fastest, but for re-measurements
    assert {CHAIN, 7, 15} & set(late)  # the others are still re-measured now and then


def test_tree_budget_with_a_cost_model_ignores_the_clock():
    from dflash_mlx.decode.budget import TreeBudget
    from dflash_mlx.decode.width import nominal_cost

    runs = []
    for clock in (1.0, 100.0):
        chooser, arms = TreeBudget(cost=nominal_cost), []
        for i in range(60):
            arm = chooser.choose()
            arms.append(arm)
            chooser.record(arm, 1 + (i % 3), clock * (i + 1), 1 + (arm or 0))
        runs.append(arms)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bad", [0, -3, "wide", 2.5, True])
def test_bad_tree_budget_is_one_line(bad):
    from dflash_mlx.errors import DFlashError
    t = TargetModel(model("llama"))
    with pytest.raises(DFlashError, match="tree_budget must be"):
        run(t, [1, 2, 3], RunnerUpOracle([1, 2, 3] + [0] * 40, 4, every=3), tree_budget=bad)


def test_cli_tree_budget_is_checked(capsys):
    from dflash_mlx.cli import main
    assert main(["generate", "-p", "hi", "--tree-budget", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tree-budget" in err[0]


def test_a_batch_keeps_each_members_tree_budget():
    from test_batching import KeyedOracle, _greedy_case, drive
    from dflash_mlx.decode.batching import Batch, BatchedGeneration

    kind = "qwen3"
    prompts, limits, refs = _greedy_case(tiny.target(kind), kind)
    _, t = tiny.make_drafter(tiny.target(kind), block_size=4)
    batch = Batch(t, KeyedOracle([p + r for p, r in zip(prompts, refs)]))
    gens = {i: BatchedGeneration(batch, p, max_tokens=m, tree_budget=b)
            for i, (p, m, b) in enumerate(zip(prompts, limits, (4, "auto", None, 8)))}
    out = drive(gens, join_after={2: 1, 3: 2})
    assert [out[i] for i in range(len(refs))] == refs
    # Trees run in batched passes too (tests/test_batched_trees.py): each member keeps the budget it asked for.
    assert [g.planner.trees is not None for g in gens.values()] == [True, True, False, True]


def test_an_unsupported_target_warns_once_and_verifies_chains():
    class OwnWalk(TargetModel):  # a target class with a walk of its own: trees cannot run through it
        def forward(self, ids, cache=None):
            return super().forward(ids, cache)

    kind = "llama"
    ref = greedy(kind, LENGTH)
    ids = prompt(LENGTH, seed=LENGTH)
    with pytest.warns(UserWarning, match="draft trees are off"):
        out, passes = run(OwnWalk(model(kind)), ids, RunnerUpOracle(ids + ref, 4, every=3), tree_budget=8)
    assert out == ref and all(p.width <= 4 for p in passes)


def test_lookup_trees_stay_within_max_tokens_and_the_lookup_width():
    from dflash_mlx.decode.generation import Generation
    from dflash_mlx.decode.lookup import LookupIndex
    from dflash_mlx.decode.state import DecodeState

    kind = "qwen3_moe"
    t = TargetModel(model(kind))
    ids = prompt(LENGTH, seed=LENGTH)
    ref = greedy(kind, LENGTH)
    for max_tokens, budget in ((3, 16), (MAX_TOKENS, 120)):
        state = DecodeState.fresh(t)
        index = LookupIndex()
        # After the prompt and the first token, the newest suffix occurred twice before, followed differently.
        other = [ref[0], (ref[1] + 1) % VOCAB, 5, 6]
        index.extend(ids + ref[:4] + ids + other)
        state.extra["lookup"] = index  # (a guess at what the context holds: drafts only)
        out = []
        with Generation(t, None, ids, max_tokens=max_tokens, lookup=True, tree_budget=budget, state=state,
                        lookup_width=8) as generation:
            for p in generation:
                out += p.tokens
                assert p.width <= max(budget, 8) + 1
        assert out == ref[:max_tokens]


def test_first_choices_are_the_chain_a_tree_stood_in_for():
    from dflash_mlx.decode.step import first_choices

    # slots: 1 (root's first child), 2 (its sibling), 3 (1's first child), 4 (3's first child), 5 (2's child)
    tree = TreeProposal(mx.array([7, 8, 9, 10, 11]), parents=(0, 0, 1, 3, 2))
    assert first_choices(tree, [1, 3, 4], 8) == (4, 3)  # the first-child chain is 3 deep, all accepted
    assert first_choices(tree, [1, 3], 8) == (4, 2)
    assert first_choices(tree, [2, 5], 8) == (4, 0)  # the runner-up was taken: the chain's first draft missed
    assert first_choices(tree, [1, 3, 4], 3) == (3, 2)  # as wide as the chain the policy chose
    assert first_choices(tree, [], None) is None


class _Schedule:
    """A width source that always answers the same width (what the width policy chose). Not `FixedWidth`: the
    planner reads that as the caller fixing the width, where trees never stand in for plain decoding."""

    def __init__(self, width: int):
        self.width = width

    def choose(self) -> int:
        return self.width

    def record(self, width: int, accepted: int, seconds: float) -> None:
        pass


def test_auto_trees_may_replace_plain_decoding_but_never_a_lookup_copy():
    from dflash_mlx.decode.budget import CHAIN, TreeBudget
    from dflash_mlx.decode.planner import Plan, Planner
    from dflash_mlx.decode.proposal import LOOKUP, PLAIN

    # The policy chose plain decoding: "auto" measures plain itself first, then the smallest tree in its place
    # (where the drafter's chains did not pay, only a tree of its runner-ups near the root may), as deep as its
    # budget allows, falling back to plain (chain width 1) where no tree grows; then the faster of the two.
    planner = Planner(_Schedule(1), trees=TreeBudget((3, 7)))
    plans = []
    for tokens in (1, 3, 3, 3):  # committed by plain, the tree of 3, then the winner
        p = planner.plan({}, room=10)
        plans.append(p)
        planner.record(p.width, tokens - 1, 1.0, p.source if p.budget is None else "dflash", p.budget, p.context)
    assert [(p.source, p.budget, p.width, p.chain_width) for p in plans[:2]] == [
        (PLAIN, CHAIN, 1, None), ("dflash", 3, 4, 1)]
    assert {p.context for p in plans} == {PLAIN} and plans[2].budget == plans[3].budget == 3
    assert planner.trees.contexts[PLAIN].arms == [CHAIN, 3]
    assert planner.plan({}, room=1).budget is None  # no room for a draft: plain
    # Without a drafter plain stays plain; a lookup copy is never replaced (the drafter's chain always may be).
    assert Planner(_Schedule(1), trees=TreeBudget((3,)), drafting=False).plan({}, room=10).source == PLAIN
    assert not planner._tree_may_replace(Plan(LOOKUP, 8), room=10)
    assert planner._tree_may_replace(Plan("dflash", 8), room=10)


def test_auto_trees_say_nothing_where_they_cannot_run():
    class OwnWalk(TargetModel):  # as above: trees cannot run through this target
        def forward(self, ids, cache=None):
            return super().forward(ids, cache)

    kind = "llama"
    ref = greedy(kind, LENGTH)
    ids = prompt(LENGTH, seed=LENGTH)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = run(OwnWalk(model(kind)), ids, RunnerUpOracle(ids + ref, 4, every=3), tree_budget="auto")
    assert out == ref


def test_front_ends_default_to_auto_trees_unless_the_width_is_fixed():
    from dflash_mlx.cli_options import tree_budget_value
    from dflash_mlx.decode.budget import DEFAULT_TREES, default_trees

    assert default_trees(DEFAULT_TREES, None) == "auto" and default_trees(DEFAULT_TREES, 8) is None
    assert default_trees(DEFAULT_TREES, None, seed=3) is None  # a seed: the server's text (chains)
    assert [default_trees(b, 8) for b in ("auto", 7, None)] == ["auto", 7, None]  # what the caller chose
    assert [tree_budget_value(t) for t in (None, "auto", "off", "7")] == [DEFAULT_TREES, "auto", None, 7]


def test_a_larger_tree_tells_smaller_budgets_what_they_would_have_committed():
    from dflash_mlx.decode.budget import TreeBudget

    chooser = TreeBudget((3, 7))
    chooser.record(3, 3, 1.0, 4)  # the tree of 3 ran once: 3 tokens in 1 s
    arms = chooser.contexts[None]
    assert arms.rate(3) == 3.0
    # A tree of 7 accepted slots 1, 4, 6: its first 3 nodes (the tree of 3) hold only slot 1 of that path.
    chooser.record(7, 4, 2.0, 8, path=[1, 4, 6])
    assert arms.rate(7) == 2.0
    assert arms.rate(3) == (0.9 * 3 + 2) / 1.9  # tokens learnt from both passes, seconds from its own
    chooser.record(7, 2, 2.0, 8, path=[2])  # a path wholly within the first 3: the same tokens
    assert arms.tokens[3] == 0.9 * (0.9 * 3 + 2) + 2 and arms.runs[3] == 1.0


def test_stream_generate_runs_trees_by_default_and_chains_when_told(monkeypatch, tmp_path):
    from dflash_mlx import api
    from dflash_mlx.decode import step
    from dflash_mlx.demo import make_tiny_pair

    model, tokenizer, drafter = api.load(*(str(p) for p in make_tiny_pair(tmp_path)))
    calls = []
    real = step.tree_segment  # every tree pass starts as a tree segment of the layer walk
    monkeypatch.setattr(step, "tree_segment", lambda *a, **k: calls.append(1) or real(*a, **k))

    def trees(**options) -> int:
        calls.clear()
        # (lookup off: with it on, this tiny model's repetitive text is mostly copied, and copies never become trees)
        tokens = [r.token for r in api.stream_generate(model, tokenizer, [5, 6, 7, 8], drafter, max_tokens=24,
                                                       lookup=False, **options)]
        assert tokens == plain_tokens, options
        return len(calls)

    plain_tokens = [r.token for r in api.stream_generate(model, tokenizer, [5, 6, 7, 8], None, max_tokens=24)]
    assert trees() > 0  # the default: auto tries its trees
    assert trees(tree_budget=None) == trees(width=4) == 0
    assert trees(temp=0.0, seed=3) == 0  # a seed: chains, as the server verifies them
