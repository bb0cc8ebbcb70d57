"""A planner that remembers (`decode.memory.PlannerMemory`): what one generation measured (pass costs per width,
acceptance per source, tree budgets) starts the next one's planner, in the server (per process) and in a chat
(per conversation); seeded sampling neither starts from it nor adds to it; output stays the target's alone."""

from __future__ import annotations

import tiny
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.memory import CARRIED_PASSES, PlannerMemory
from dflash_mlx.decode.planner import build_planner
from dflash_mlx.decode.proposers.dflash import DFlashProposer

KIND = "qwen3"


def _pair():
    model = tiny.target(KIND)
    drafter, t = tiny.make_drafter(model, block_size=8)
    return model, drafter, t


def _run(t, drafter, prompt, **options):
    gen = Generation(t, drafter, prompt, max_tokens=20, **options)
    tokens = [tok for p in gen for tok in p.tokens]
    return gen, tokens


def test_the_next_generation_starts_from_what_the_last_measured():
    model, drafter, t = _pair()
    memory = PlannerMemory()
    prompt = tiny.prompt_ids(9, seed=1)
    first, out1 = _run(t, drafter, prompt, memory=memory, tree_budget="auto")
    assert out1 == tiny.reference(KIND, prompt, 20)
    assert memory.generations == 1
    learnt = first.planner.policy
    assert learnt.costs and sum(learnt.trials) > 0
    # A new generation's planner holds those measurements before its first pass: no cold probes.
    second = Generation(t, drafter, tiny.prompt_ids(7, seed=2), max_tokens=20, memory=memory, tree_budget="auto")
    policy = second.planner.policy
    assert policy.costs == learnt.costs  # the machine's costs, as measured
    # The drafter's acceptance: the same ratios per slot, at the weight of a few passes at most.
    for h, t, lh, lt in zip(policy.hits[1:], policy.trials[1:], learnt.hits[1:], learnt.trials[1:]):
        assert t <= CARRIED_PASSES + 1e-9 and (t == lt == 0 or abs(h / t - lh / lt) < 1e-9)
    assert policy is not learnt and policy.costs is not learnt.costs  # copies: the two never share state
    arms = second.planner.trees.contexts
    assert arms and {c: dict(a.tries) for c, a in arms.items()} == \
        {c: dict(a.tries) for c, a in first.planner.trees.contexts.items()}
    # ... and its output is still the target's own.
    out2 = [tok for p in second for tok in p.tokens]
    assert out2 == tiny.reference(KIND, tiny.prompt_ids(7, seed=2), 20)
    assert memory.generations == 2


def test_a_fresh_planner_probes_and_a_remembered_one_does_not_repeat_the_first_wide_pass():
    """Cold, the first drafting pass is the drafter's whole block (nothing measured); seeded, it is whatever the
    measurements say is best (here a width policy told that drafts are never accepted: plain decoding)."""
    _, drafter, t = _pair()
    proposer = DFlashProposer(drafter, drafter.mask_token_id)
    cold = build_planner(drafting=proposer)
    assert cold.policy.choose() == 8
    taught = build_planner(drafting=proposer)
    for _ in range(40):  # every pass: nothing accepted; a wide pass costs twice a plain one
        taught.record(8, 0, 0.2)
        taught.record(1, 0, 0.1)
    memory = PlannerMemory()
    memory.keep(taught)
    seeded = build_planner(drafting=proposer)
    assert memory.seed(seeded)
    assert seeded.policy.choose() == 1


def test_carried_acceptance_weighs_a_few_passes_so_a_new_request_moves_it_at_once():
    _, drafter, t = _pair()
    proposer = DFlashProposer(drafter, drafter.mask_token_id)
    taught = build_planner(drafting=proposer, lookup=True)
    for _ in range(200):  # a long reply whose drafts were never accepted
        taught.record(8, 0, 0.2)
    memory = PlannerMemory()
    memory.keep(taught)
    seeded = build_planner(drafting=proposer, lookup=True)
    memory.seed(seeded)
    assert seeded.policy.acceptance()[0] < 0.1
    for _ in range(4):  # the new request's drafts are all accepted
        seeded.record(8, 7, 0.2)
    assert seeded.policy.acceptance()[0] > 0.3  # (200 passes' weight would have kept it under 0.05)


def test_shapes_that_do_not_fit_are_not_seeded():
    _, drafter, t = _pair()
    proposer = DFlashProposer(drafter, drafter.mask_token_id)
    memory = PlannerMemory()
    taught = build_planner(drafting=proposer)
    taught.record(8, 3, 0.2)
    memory.keep(taught)
    other = build_planner(drafting=proposer, max_width=4)  # another widest width: its slots mean other things
    assert not memory.seed(other) and not other.policy.costs


def test_seeded_sampling_neither_reads_nor_writes_the_memory():
    _, drafter, t = _pair()
    memory = PlannerMemory()
    prompt = tiny.prompt_ids(9, seed=1)
    _run(t, drafter, prompt, memory=memory)  # greedy: kept
    assert memory.generations == 1
    gens = [Generation(t, drafter, prompt, max_tokens=16, memory=memory, temp=0.8, seed=5) for _ in range(2)]
    assert all(g.memory is None for g in gens)
    outs = [[tok for p in g for tok in p.tokens] for g in gens]
    alone = [tok for p in Generation(t, drafter, prompt, max_tokens=16, temp=0.8, seed=5) for tok in p.tokens]
    assert outs[0] == outs[1] == alone  # the seed alone decides, memory or not
    assert memory.generations == 1


def test_the_server_remembers_across_requests_and_a_chat_across_turns(tmp_path):
    from dflash_mlx.chat import ChatSession
    from dflash_mlx.api import load
    from dflash_mlx.demo import make_tiny_pair
    from dflash_mlx.server.generation import GenerationRequest, Generator, Outcome

    target_dir, drafter_dir = make_tiny_pair(tmp_path)
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    generator = Generator(model, tokenizer, drafter)
    assert not generator.memory
    for i, text in enumerate(("def add(a, b):", "class Stack:")):
        ids = tokenizer.encode(text)
        events = list(generator.run(GenerationRequest(prompt=ids, max_tokens=12)))
        assert isinstance(events[-1], Outcome)
        assert generator.memory.generations == i + 1
    session = ChatSession(model, tokenizer, drafter, max_tokens=8)
    for turn, text in enumerate(("hello", "and again")):
        "".join(session.send(text))
        assert session.memory.generations == turn + 1
