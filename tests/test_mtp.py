"""The target's MTP layers as a drafter (dflash_mlx/drafters/mtp.py, dflash_mlx/decode/proposers/mtp.py).

Tiny random fp32 Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints with `mtp.*` tensors in the Hugging Face layout
(benchmarks/mtp_reference.py builds them) are loaded as mlx-lm loads the target, and the MTP block from the same
folder. Checked: greedy output equals plain greedy decoding at 1, 2, 3 and 5 drafts; tokens and drafts accepted per
pass equal the reference implementation's (mlx-vlm, recorded in tests/fixtures/mtp/); the MTP block alone equals the
reference's on every family; sampled output follows the target's exact distribution; a withdrawn or taken-back
pass leaves the draft state as it was; one-line errors without MTP tensors; sharded and quantized checkpoints.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from benchmarks.mtp_reference import DRAFTS, KINDS, MAX_TOKENS, PROMPT, VOCAB, save_checkpoint
from dflash_mlx.decode.acceptance import GreedyAcceptor, SamplingAcceptor
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.planner import build_planner
from dflash_mlx.decode.proposers.mtp import MTPProposer
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.decode.step import Decoder, drafting_proposer, proposers_for
from dflash_mlx.drafters import mtp as mtp_module
from dflash_mlx.drafters.dflash import TargetBinding
from dflash_mlx.drafters.mtp import MTPDrafter, load_mtp_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import build_target

FIXTURES = Path(__file__).parent / "fixtures" / "mtp"


def prepare(model, drafter):
    """What `models.loading.prepare` does for a drafter: tap its layer, bind the target's embedding and head."""
    target = build_target(model, drafter.config.target_layer_ids)
    drafter.bind(TargetBinding(target.embed, functools.partial(target.head, softcap=False), None, source=target))
    return target


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for kind in KINDS:
        folder = save_checkpoint(kind, root / kind)
        model, _ = mlx_lm_load(str(folder))
        drafter = load_mtp_drafter(folder, model)
        out[kind] = (folder, model, drafter, prepare(model, drafter))
    return out


def plain(model, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


def decode(target, drafter, drafts, prompt=PROMPT, max_tokens=MAX_TOKENS, **kw):
    passes = list(Generation(target, drafter, prompt, max_tokens=max_tokens, width=drafts + 1, lookup=False, **kw))
    return [t for p in passes for t in p.tokens], passes[1:]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_decoding(pairs, kind):
    folder, model, drafter, target = pairs[kind]
    expected = plain(model, PROMPT, MAX_TOKENS)
    for k in DRAFTS:
        tokens, passes = decode(target, drafter, k)
        assert tokens == expected, (kind, k)
        drafted = [p for p in passes if p.width > 1]
        assert drafted and all(p.source == "mtp" for p in drafted)
        assert any(p.accepted > 0 for p in drafted) and any(p.accepted < p.width - 1 for p in drafted), (kind, k)
    # A prefill in chunks: the MTP runs each chunk's known pairs as it goes.
    assert decode(target, drafter, 3, prefill_step_size=4)[0] == expected


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_and_acceptance_per_pass_equal_the_reference(pairs, kind):
    fixture = json.loads((FIXTURES / f"{kind}.json").read_text())
    folder, model, drafter, target = pairs[kind]
    assert fixture["prompt"] == PROMPT and fixture["plain"] == plain(model, PROMPT, MAX_TOKENS)
    for k, run in fixture["runs"].items():  # none for qwen3_next: the reference cannot decode it end to end
        tokens, passes = decode(target, drafter, int(k))
        assert tokens == run["tokens"], (kind, k)
        assert [p.accepted for p in passes] == run["accepted"], (kind, k)
    # The MTP block alone, every family: (final-normed target hidden at t, token t+1) -> argmax at t+2.
    seq = PROMPT + fixture["plain"]
    ids = mx.array([seq], dtype=mx.int32)
    _, tapped = target(ids)
    cache = drafter.make_cache()
    out = drafter.forward(ids[:, 1:], drafter.target.norm(tapped[:, :-1]), cache)
    assert mx.argmax(drafter.logits(out)[0], axis=-1).tolist() == fixture["mtp_argmax"]


def test_the_proposer_comes_from_the_drafter(pairs):
    drafter = pairs["qwen3_5"][2]
    proposer = drafting_proposer(drafter)
    assert isinstance(proposer, MTPProposer) and proposer.name == "mtp" and proposer.widest == drafter.block_size
    assert drafter.mask_token_id is None and drafter.config.target_layer_ids == [3]


def _state(cache):
    """Everything the draft cache holds, as host values."""
    kv = [(c.offset, np.array(c.keys[..., : c.offset, :]) if c.offset else None) for c in cache[:-1]]
    p = cache[-1]
    return kv, (None if p.hidden is None else np.array(p.hidden)), list(p.tokens), p.skip, \
        (None if p.seed is None else np.array(p.seed))


def _same(a, b):
    assert a[0][0][0] == b[0][0][0]
    np.testing.assert_array_equal(a[0][0][1], b[0][0][1])
    for x, y in zip(a[1:], b[1:]):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def test_withdraw_and_take_back_leave_the_draft_state_as_it_was(pairs):
    folder, model, drafter, target = pairs["qwen3_5"]
    expected = plain(model, PROMPT, 30)
    proposer = MTPProposer(drafter)
    state = DecodeState.fresh(target, drafter)
    planner = build_planner(drafting=proposer, width=4)
    dec = Decoder(target, drafter, proposers_for(proposer, None), planner, GreedyAcceptor(), state, max_tokens=30)
    tokens = dec.start(mx.array(PROMPT)).tokens

    def launch():
        proposal = dec.propose()
        logits, hidden = target(dec.block(proposal), state.target_cache)
        return dec.verify(proposal, logits[0], hidden)

    i = 0
    while dec.wants:
        before = _state(state.draft_cache)
        dec.withdraw(launch())  # abandoned before it commits
        _same(_state(state.draft_cache), before)
        if i % 3 == 1 and dec.limit - dec.emitted > 1:  # finished, then taken back unseen (an MTP pass)
            done = launch()
            dec.finish(done, done.packed.tolist(), 0.0)
            dec.take_back(done)
            _same(_state(state.draft_cache), before)
        if i % 3 == 2:  # a plain pass taken back: the step tells the other proposers to forget what they saw
            done = launch_plain(dec, target, state)
            dec.finish(done, done.packed.tolist(), 0.0)
            dec.take_back(done)
            if "unobserve" not in inspect.getsource(Decoder.take_back):  # until the step does it itself
                proposer.unobserve(state, done.kept)
            _same(_state(state.draft_cache), before)
        done = launch()
        tokens += dec.finish(done, done.packed.tolist(), 0.0).tokens
        i += 1
    # (take_back does not give the token budget back, so the generation ends a little early)
    assert tokens == expected[: len(tokens)] and len(tokens) > 15 and i > 5


def launch_plain(dec, target, state):
    """A plain decoding pass (width 1) of the same generation."""
    from dflash_mlx.decode.proposal import Proposal

    proposal = Proposal.empty()
    logits, hidden = target(dec.block(proposal), state.target_cache)
    return dec.verify(proposal, logits[0], hidden)


def test_sampled_output_follows_the_target_distribution(tmp_path):
    from test_sampling import chi2_pvalue, exact_target_joint, joint_counts

    V = 8
    folder = save_checkpoint("qwen3_5", tmp_path / "v8", seed=3, vocab_size=V)
    model, _ = mlx_lm_load(str(folder))
    drafter = load_mtp_drafter(folder, model)
    target = prepare(model, drafter)
    params, prompt = SamplingParams(temp=1.5), [1, 5, 2, 7]
    seqs, accepted = [], 0
    for seed in range(400):
        passes = list(Generation(target, drafter, prompt, max_tokens=4, width=3, lookup=False,
                                 acceptor=SamplingAcceptor(params, seed=seed)))
        seqs.append([t for p in passes for t in p.tokens][:3])
        accepted += sum(p.accepted for p in passes)
    assert chi2_pvalue(joint_counts(np.array(seqs), V), exact_target_joint(model, prompt, params)) > 1e-3
    assert accepted > 100  # the MTP's drafts are accepted often: the test exercises acceptance, not only rejection


def test_a_checkpoint_without_mtp_tensors_is_one_line(tmp_path):
    folder = save_checkpoint("qwen3_5", tmp_path / "bare", with_mtp=False)
    with pytest.raises(DFlashError, match=r"has no MTP layers \(mtp\.\* tensors\); use a DFlash drafter") as e:
        load_mtp_drafter(folder)
    assert "\n" not in str(e.value)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DFlashError, match=r"\(llama\) has no MTP layers") as e:
        load_mtp_drafter(other)
    assert "\n" not in str(e.value)


def test_a_sharded_checkpoint_reads_only_the_mtp_shard(tmp_path, pairs, monkeypatch):
    folder = save_checkpoint("qwen3_5", tmp_path / "sharded", shards=3)
    assert (folder / "model.safetensors.index.json").is_file()
    read = []
    original = mtp_module._read
    monkeypatch.setattr(mtp_module, "_read", lambda path, keys: read.append(path.name) or original(path, keys))
    drafter = load_mtp_drafter(folder)
    assert read == ["model-00003-of-00003.safetensors"]
    whole = dict(tree_flatten(pairs["qwen3_5"][2].parameters()))
    for name, value in tree_flatten(drafter.parameters()):
        assert mx.array_equal(value, whole[name]).item(), name


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_quantized_mlx_checkpoint_loads_and_stays_lossless(tmp_path, pairs, kind):
    """An MLX-layout checkpoint (norms already shifted, conv1d moved) whose mtp.* linear layers are 8-bit."""
    folder0, model, drafter0, _ = pairs[kind]
    quantized = load_mtp_drafter(folder0)
    nn.quantize(quantized, group_size=32, bits=8)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({"mtp." + k: v for k, v in tree_flatten(quantized.parameters())})
    folder = tmp_path / kind
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((folder0 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization={"group_size": 32, "bits": 8})))
    model2, _ = mlx_lm_load(str(folder))
    drafter = load_mtp_drafter(folder, model2)
    assert isinstance(drafter.fc, nn.QuantizedLinear)
    for name, value in tree_flatten(quantized.parameters()):
        assert mx.array_equal(value, dict(tree_flatten(drafter.parameters()))[name]).item(), name
    target = prepare(model2, drafter)
    tokens, passes = decode(target, drafter, 3, max_tokens=20)
    assert tokens == plain(model2, PROMPT, 20) and any(p.accepted for p in passes)


def test_drafter_shape(pairs):
    drafter: MTPDrafter = pairs["qwen3_5_moe"][2]
    cache = drafter.make_cache()
    assert len(cache) == 2 and cache[-1].empty() and not cache[-1].is_trimmable()
    copy = cache[-1].copy()
    copy.tokens.append(1)
    assert cache[-1].tokens == []


def test_lookup_adaptive_widths_a_batch_and_a_second_turn_stay_lossless(pairs):
    """The MTP beside prompt lookup and plain passes (adaptive widths), in a shared batch, and continuing a
    conversation's state into a second turn: the output is still the target's greedy output."""
    from dflash_mlx.decode.batching import Batch, BatchedGeneration

    folder, model, drafter, target = pairs["qwen3_5_moe"]
    expected = plain(model, PROMPT, MAX_TOKENS)
    echo = PROMPT + expected[:12] + PROMPT  # repeats itself, so lookup finds copies
    passes = list(Generation(target, drafter, echo, max_tokens=MAX_TOKENS, lookup=True))
    assert [t for p in passes for t in p.tokens] == plain(model, echo, MAX_TOKENS)
    assert {"mtp"} <= {p.source for p in passes[1:]}

    batch = Batch(target, drafter)
    prompts = [PROMPT, PROMPT[3:]]
    gens = [iter(BatchedGeneration(batch, p, max_tokens=20, width=3, lookup=False)) for p in prompts]
    out, live = [[], []], {0, 1}
    while live:
        for i in sorted(live):
            try:
                out[i] += next(gens[i]).tokens
            except StopIteration:
                live.discard(i)
    assert out == [plain(model, p, 20) for p in prompts] and max(batch.sizes) == 2

    state = DecodeState.fresh(target, drafter)
    first = [t for p in Generation(target, drafter, PROMPT, max_tokens=10, width=3, state=state, lookup=False)
             for t in p.tokens]
    follow = [5, 17, 29]
    second = [t for p in Generation(target, drafter, follow, max_tokens=15, width=4, state=state, lookup=False)
              for t in p.tokens]
    assert second == plain(model, PROMPT + first + follow, 15)


class _NeverAccepted(MTPProposer):
    """The MTP proposer with every draft replaced by a token the target never chooses here."""

    def __init__(self, drafter, token):
        super().__init__(drafter)
        self.token = token

    def propose(self, state, acceptor, width, offer):
        proposal = super().propose(state, acceptor, width, offer)
        wrong = mx.full(proposal.tokens.shape, self.token, dtype=mx.int32)
        self._undo.tokens = wrong  # what observe and withdraw compare against
        return replace(proposal, tokens=wrong)


def test_the_collapse_warning_fires_for_mtp(pairs, caplog):
    """The acceptance-collapse watch judges every drafting proposer, not only a DFlash drafter's blocks."""
    import logging

    folder, model, drafter, target = pairs["qwen3_5"]
    expected = plain(model, PROMPT, MAX_TOKENS)
    never = next(t for t in range(VOCAB) if t not in expected)
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        gen = Generation(target, drafter, PROMPT, max_tokens=MAX_TOKENS, width=3, lookup=False,
                         proposer=_NeverAccepted(drafter, never))
        passes = list(gen)
    assert [t for p in passes for t in p.tokens] == expected
    drafted = [p for p in passes[1:] if p.width > 1]
    assert len(drafted) >= 32 and all(p.source == "mtp" and p.accepted == 0 for p in drafted)
    assert gen.stats.drafted_cycles == len(drafted)
    messages = [r.getMessage() for r in caplog.records if "acceptance collapsed" in r.getMessage()]
    assert len(messages) == 1 and "drafting is slower than plain decoding" in messages[0]
    assert "own MTP layers" in messages[0] and "another fine-tune" not in messages[0]  # no separate drafter
