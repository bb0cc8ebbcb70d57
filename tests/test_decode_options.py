"""The decode options are decided once, where the planner and the pass step are built: whether trees can run (the
target and its cache, the drafting proposer under its acceptor) is settled before any pass, with one warning for a
fixed budget that cannot run; nothing that runs the planner turns trees off; the pass step alone says why a
generation ends; `dflash-mlx serve` hands --tree-budget to the server's settings by name."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

import tiny
from dflash_mlx.decode.acceptance import GreedyAcceptor, make_acceptor
from dflash_mlx.decode.budget import FixedBudget, TreeBudget
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.planner import build_planner
from dflash_mlx.decode.proposers.dflash import DFlashProposer
from dflash_mlx.decode.proposers.mtp import MTPProposer
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel

KIND = "llama"
MAX_TOKENS = 16


class OwnWalk(TargetModel):
    """A target class with a walk of its own: trees cannot run through it (`targets.tree.tree_support`)."""

    def forward(self, ids, cache=None):
        return super().forward(ids, cache)


def _case():
    ids = tiny.prompt_ids(12, seed=3)
    ref = tiny.reference(KIND, ids, MAX_TOKENS)
    return ids, ref, OracleDrafter(ids + ref, tiny.VOCAB, 4, tiny.VOCAB - 1)


def _run(generation) -> list:
    with generation:
        return [t for p in generation for t in p.tokens]


def _tree_warnings(caught) -> list:
    return [w for w in caught if "draft trees are off" in str(w.message)]


def test_a_fixed_budget_the_target_cannot_take_is_refused_at_build_time_with_one_warning():
    ids, ref, drafter = _case()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning counts, not only the first at each place
        generation = Generation(OwnWalk(tiny.target(KIND)), drafter, ids, max_tokens=MAX_TOKENS, tree_budget=8)
        # Decided before any pass step exists: chains, said once, to whoever asked for the budget.
        assert generation.planner.trees is None and len(_tree_warnings(caught)) == 1
        assert _run(generation) == ref
    assert len(_tree_warnings(caught)) == 1  # running it says nothing more
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation = Generation(OwnWalk(tiny.target(KIND)), drafter, ids, max_tokens=MAX_TOKENS, tree_budget="auto")
        assert generation.planner.trees is None and _run(generation) == ref
    assert _tree_warnings(caught) == []  # "auto" means trees where they can run: nothing to say
    supported = Generation(TargetModel(tiny.target(KIND)), drafter, ids, max_tokens=MAX_TOKENS, tree_budget=8)
    assert isinstance(supported.planner.trees, FixedBudget)
    # A planner of the caller's, built with a budget but without the target, is held against it too.
    own = build_planner(drafting=DFlashProposer(drafter), tree_budget=8)
    assert isinstance(own.trees, FixedBudget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation = Generation(OwnWalk(tiny.target(KIND)), drafter, ids, max_tokens=MAX_TOKENS, planner=own)
        assert own.trees is None and _run(generation) == ref
    assert len(_tree_warnings(caught)) == 1


def test_build_planner_asks_the_target_the_cache_and_the_drafting_proposer():
    ids, _, drafter = _case()
    t = TargetModel(tiny.target(KIND))
    cache = t.make_cache()
    dflash = DFlashProposer(drafter)
    assert isinstance(build_planner(drafting=dflash, tree_budget="auto", target=t, cache=cache,
                                    acceptor=GreedyAcceptor()).trees, TreeBudget)
    # Logits processors make each node's row depend on its own path: the DFlash proposer grows no tree then.
    penalized = make_acceptor(repetition_penalty=1.3)
    assert build_planner(drafting=dflash, tree_budget=6, target=t, cache=cache, acceptor=penalized).trees is None
    # A proposer that drafts chains only (the base class's default) gets a chain planner from the start.
    assert build_planner(drafting=MTPProposer(drafter), tree_budget=6, target=t, cache=cache).trees is None
    # A quantized cache cannot take trees either; a fixed budget says so while the planner is built.
    from mlx_lm.models.cache import QuantizedKVCache

    quantized = [QuantizedKVCache() for _ in cache]
    with pytest.warns(UserWarning, match="quantized KV cache"):
        assert build_planner(drafting=dflash, tree_budget=6, target=t, cache=quantized).trees is None


class _SometimesNoTree:
    """A caller's proposer (the shape, no base class) that says it grows trees but grows none this time: the pass
    verifies its chain, and the planner keeps its budget for later passes."""

    def __init__(self, inner: DFlashProposer):
        self.inner, self.name, self.widest = inner, inner.name, inner.widest
        self.asked = 0

    def offer(self, state, widest):
        return self.inner.offer(state, widest)

    def propose(self, state, acceptor, width, offer):
        return self.inner.propose(state, acceptor, width, offer)

    def observe(self, state, tokens, features):
        self.inner.observe(state, tokens, features)

    def withdraw(self, state, proposal):
        self.inner.withdraw(state, proposal)

    def grows_trees(self, acceptor):
        return True

    def propose_tree(self, state, acceptor, width, budget, offer):
        self.asked += 1
        return None


def test_nothing_that_runs_the_planner_turns_its_trees_off():
    ids, ref, drafter = _case()
    proposer = _SometimesNoTree(DFlashProposer(drafter))
    generation = Generation(TargetModel(tiny.target(KIND)), drafter, ids, max_tokens=MAX_TOKENS, tree_budget=4,
                            proposer=proposer)
    trees = generation.planner.trees
    assert isinstance(trees, FixedBudget)
    assert _run(generation) == ref
    # Every drafting pass asked for its tree again: no pass step decided "no trees from now on".
    assert proposer.asked > 1 and generation.planner.trees is trees


def test_the_pass_step_says_why_a_generation_ends():
    from dflash_mlx.decode.loop import dflash_generate_step

    ids, ref, drafter = _case()
    t = TargetModel(tiny.target(KIND))
    passes = list(dflash_generate_step(mx.array(ids, dtype=mx.int32), t, drafter, max_tokens=MAX_TOKENS))
    assert [p.finish_reason for p in passes[:-1]] == [None] * (len(passes) - 1)
    assert passes[-1].finish_reason == "length" and sum(len(p.tokens) for p in passes) == MAX_TOKENS
    stop = ref[5]
    passes = list(dflash_generate_step(mx.array(ids, dtype=mx.int32), t, drafter, max_tokens=MAX_TOKENS,
                                       stop_tokens=[stop]))
    tokens = [x for p in passes for x in p.tokens]
    assert passes[-1].finish_reason == "stop" and tokens == ref[: ref.index(stop) + 1]
    # A Generation reports the pass step's reason as it is.
    generation = Generation(t, drafter, ids, max_tokens=3)
    assert [p.finish_reason for p in generation][-1] == "length" and generation.finish_reason == "length"


def test_serve_hands_the_tree_budget_to_the_settings_by_name(monkeypatch):
    import dflash_mlx.server as server_pkg
    from dflash_mlx.cli import main
    from dflash_mlx.decode.budget import DEFAULT_TREES

    seen = []
    monkeypatch.setattr(server_pkg, "serve_from_cli", lambda **kw: seen.append(kw["settings"].tree_budget))
    for flag, budget in ((["--tree-budget", "7"], 7), (["--tree-budget", "off"], None),
                         (["--tree-budget", "auto"], "auto"), ([], DEFAULT_TREES)):
        assert main(["serve", *flag]) in (0, None)
        assert seen[-1] == budget, flag
