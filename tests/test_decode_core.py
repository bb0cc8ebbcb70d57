"""The decode core's interfaces (dflash_mlx/decode/): a proposer written outside the package plugs into the loop and
the batch and stays lossless; proposals are values; the planner built from a generation's options; the renamed
arguments keep working under their old names."""


import mlx.core as mx
import pytest

import tiny
from dflash_mlx import api
from dflash_mlx.decode.acceptance import SamplingAcceptor
from dflash_mlx.decode.batching import Batch, BatchedGeneration
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.planner import build_planner
from dflash_mlx.decode.proposal import DFLASH, LOOKUP, PLAIN, Offer
from dflash_mlx.decode.proposers.dflash import DFlashProposer
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.decode.width import nominal_cost
from dflash_mlx.demo import make_tiny_pair


class EchoProposer:
    """A drafting method defined here, not in the package: it proposes the known continuation, spoiling every
    `spoil`-th position, so passes accept some drafts and reject others."""

    name = "echo"

    def __init__(self, sequence, widest=4, spoil=3):
        self.sequence, self.widest, self.spoil = list(sequence), widest, spoil
        self.seen = 0  # tokens the target has committed so far, the prompt included
        self.proposed = 0

    def offer(self, state, widest):
        return Offer(self.name, min(widest, self.widest))

    def propose(self, state, acceptor, width, offer):
        self.proposed += 1
        start = self.seen  # the block's slot 0 is token seen-1; its drafts continue from position `seen`
        drafts = [(self.sequence[p] + (p % self.spoil == 0)) % tiny.VOCAB if p < len(self.sequence) else 0
                  for p in range(start, start + width - 1)]
        return acceptor.propose_tokens(mx.array(drafts, dtype=mx.int32))

    def observe(self, state, tokens, features):
        self.seen += len(tokens)

    def withdraw(self, state, proposal):
        pass


@pytest.mark.parametrize("kind", tiny.ALL_KINDS)
def test_a_proposer_from_outside_the_package_is_lossless(kind):
    model = tiny.target(kind)
    t = tiny.TargetModel(model, [0])
    prompt = tiny.prompt_ids(9, seed=4)
    expected = tiny.reference(kind, prompt, 30)
    for width in (2, 4, None):  # fixed widths and the planner's choice
        echo = EchoProposer(prompt + expected, widest=4)
        passes = list(Generation(t, None, prompt, max_tokens=30, width=width, proposer=echo, lookup=False))
        assert [tok for p in passes for tok in p.tokens] == expected, (kind, width)
        drafted = [p for p in passes[1:] if p.width > 1]
        assert drafted and all(p.source == "echo" for p in drafted)
        assert any(p.accepted > 0 for p in drafted) and any(p.accepted < p.width - 1 for p in drafted)
        assert echo.proposed == len(drafted)


def test_a_proposer_from_outside_the_package_shares_batched_passes():
    model = tiny.target("qwen3")
    t = tiny.TargetModel(model, [0])
    prompts = [tiny.prompt_ids(n, seed=n) for n in (7, 11)]
    refs = [tiny.reference("qwen3", p, 20) for p in prompts]
    batch = Batch(t, None)
    gens = [BatchedGeneration(batch, p, max_tokens=20, width=3, proposer=EchoProposer(p + r), lookup=False)
            for p, r in zip(prompts, refs)]
    streams = [iter(g) for g in gens]
    out = [[], []]
    live = {0, 1}
    while live:
        for i in sorted(live):
            try:
                out[i] += next(streams[i]).tokens
            except StopIteration:
                live.discard(i)
    assert out == refs
    assert max(batch.sizes) == 2  # both were verified in the same target passes


def test_a_proposal_is_a_value_verified_after_another_one_was_made():
    acceptor = SamplingAcceptor(SamplingParams(temp=1.0), seed=3)
    V = 8
    fixed = acceptor.propose_tokens(mx.array([5], dtype=mx.int32))  # a point mass on token 5
    other = acceptor.propose(mx.zeros((3, V)))  # another proposal made before the first is verified
    assert other.logq.shape == (3, V) and other.cut(1).logq.shape == (1, V) and other.cut(1).width == 2
    # The target is sure of token 5 after slot 0: the point-mass draft is always accepted, whatever came since.
    target_logits = mx.where(mx.arange(V) == 5, 50.0, -50.0)[None].astype(mx.float32)
    target_logits = mx.concatenate([target_logits, mx.zeros((1, V))])
    for _ in range(5):
        acc, _ = acceptor.verify(fixed, target_logits)
        assert int(acc.item()) == 1


def test_the_planner_follows_the_generation_options():
    model = tiny.target("llama")
    drafter, _ = tiny.make_drafter(model, block_size=4)
    dflash = DFlashProposer(drafter)
    offers = {DFLASH: Offer(DFLASH, 4)}
    plain = build_planner(drafting=None)
    assert plain.plan({}, room=10).source == PLAIN and plain.plan({}, room=10).width == 1
    fixed = build_planner(drafting=dflash, width=3)
    assert (fixed.plan(offers, room=10).source, fixed.plan(offers, room=10).width) == (DFLASH, 3)
    assert fixed.plan(offers, room=2).width == 2 and not fixed.cuts  # the token limit caps a pass
    seeded = build_planner(drafting=dflash, reproducible=True)
    assert seeded.cuts and seeded.cutter.fixed_cost is nominal_cost  # widths from acceptance, not the clock
    with_lookup = build_planner(drafting=dflash, lookup=True, lookup_width=8)
    assert with_lookup.choice is not None and with_lookup.widest(LOOKUP) == 8
    copy = Offer(LOOKUP, 6, [1, 2, 3, 4, 5], match=16)
    plan = with_lookup.plan({LOOKUP: copy, DFLASH: Offer(DFLASH, 4)}, room=10)
    assert plan.source == LOOKUP and plan.offer.tokens == [1, 2, 3, 4, 5][: plan.width - 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return api.load(str(target_dir), str(drafter_dir))


def test_a_width_is_a_number_of_tokens(pair):
    """A width policy is a planner argument: given as `width=` it is refused in one line that says where it goes."""
    from dflash_mlx.decode.width import WidthPolicy
    from dflash_mlx.errors import DFlashError

    model, tokenizer, drafter = pair
    with pytest.raises(DFlashError, match=r"width is the tokens verified per pass \(an int\); give a width policy"):
        next(api.stream_generate(model, tokenizer, "hello", drafter, max_tokens=4, width=WidthPolicy(4)))


def test_a_fixed_width_wins_over_a_planner_and_a_policy_is_a_planner_argument():
    from dflash_mlx.decode.loop import dflash_generate_step
    from dflash_mlx.decode.width import WidthPolicy

    model = tiny.target("qwen3")
    drafter, t = tiny.make_drafter(model, block_size=4)
    prompt = tiny.prompt_ids(8, seed=2)
    expected = tiny.reference("qwen3", prompt, 16)
    fixed = list(Generation(t, drafter, prompt, max_tokens=16, width=2, planner=WidthPolicy(4)))
    assert {p.width for p in fixed[1:]} <= {1, 2} and [x for p in fixed for x in p.tokens] == expected
    policy = WidthPolicy(4)
    passes = list(dflash_generate_step(mx.array(prompt, dtype=mx.int32), t, drafter, max_tokens=16, planner=policy))
    assert [x for p in passes for x in p.tokens] == expected and policy.cycles == len(passes) - 1


def test_a_drafter_without_mask_id_is_refused_before_anything_runs_and_only_for_its_own_request():
    from dflash_mlx.decode.loop import dflash_generate_step
    from dflash_mlx.errors import DFlashError

    model = tiny.target("qwen3")
    drafter, t = tiny.make_drafter(model, block_size=4)
    drafter.config.mask_token_id = None  # as a config.json without one reads
    steps = dflash_generate_step(mx.array(tiny.prompt_ids(6), dtype=mx.int32), t, drafter, max_tokens=8)
    with pytest.raises(DFlashError, match="mask_token_id"):
        next(steps)  # not even the prefill's token
    plain = list(dflash_generate_step(mx.array(tiny.prompt_ids(6), dtype=mx.int32), t, drafter, max_tokens=8,
                                      width=1))
    assert [x for p in plain for x in p.tokens] == tiny.reference("qwen3", tiny.prompt_ids(6), 8)
    batch = Batch(t, drafter)
    good = BatchedGeneration(batch, tiny.prompt_ids(7, seed=1), max_tokens=10, width=3, mask_token_id=tiny.VOCAB - 1)
    bad = BatchedGeneration(batch, tiny.prompt_ids(5, seed=2), max_tokens=10, width=3)
    first = next(iter(good))
    with pytest.raises(DFlashError, match="mask_token_id"):
        next(iter(bad))
    rest = [x for p in good for x in p.tokens]
    assert first.tokens + rest == tiny.reference("qwen3", tiny.prompt_ids(7, seed=1), 10)
