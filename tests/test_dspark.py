"""The DSpark drafter family: every packaging loads, drafts like the reference, and decoding stays lossless.

Parity: tiny random checkpoints in each published packaging (tests/fixtures/make_dspark.py writes them; the tests
write them again) are compared with the reference implementation's outputs committed in tests/fixtures/dspark/:
the draft rows (parallel logits + Markov term) and confidences of two consecutive cached draft steps (fp32, 1e-4),
and the accepted drafts per verify pass of the reference's greedy loop on a tiny target.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tiny
from dflash_mlx.decode.acceptance import SamplingAcceptor
from dflash_mlx.convert.drafter import convert_drafter
from dflash_mlx.drafters.dflash import TargetBinding
from dflash_mlx.drafters.families import describe
from dflash_mlx.drafters.io import load_drafter, read_config
from dflash_mlx.drafters.dspark import DSparkDrafter
from dflash_mlx.drafters.dspark_config import DSparkConfig
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.loading import load_target, prepare
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.targets import TargetModel
from dflash_mlx.decode.width import WidthPolicy, nominal_cost

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import make_dspark  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "dspark"
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    return {name: make_dspark.write_checkpoint(root / name, name) for name in make_dspark.PACKAGINGS}


def _bind_if_borrowing(drafter):
    """A head without its own LM head (Nemotron) projects with the tiny qwen3 target's, as the reference does."""
    if not drafter.config.has_own_lm_head:
        t = TargetModel(tiny.target("qwen3"), drafter.config.target_layer_ids)
        drafter.bind(TargetBinding(t.embed, functools.partial(t.head, softcap=False), source=t))
    return drafter


def _block(drafter, anchor):
    return mx.array([[anchor] + [drafter.mask_token_id] * (drafter.block_size - 1)], dtype=mx.int32)


@pytest.mark.parametrize("name", list(make_dspark.PACKAGINGS))
def test_two_cached_draft_steps_match_the_reference(name, checkpoints):
    ref = np.load(FIXTURES / f"{name}.npz")
    drafter = _bind_if_borrowing(load_drafter(checkpoints[name]))
    assert isinstance(drafter, DSparkDrafter) and describe(drafter).startswith("DSpark drafter")
    cfg = drafter.config
    assert cfg.logits_start == int(ref["logits_start"])
    assert drafter.block_size == len(ref["drafts0"]) + 1  # widest verify pass = drafts + bonus
    cache = drafter.make_cache()
    for step, (feat, anchor) in enumerate(zip(make_dspark.features(), make_dspark.ANCHORS)):
        drafter.append_context(mx.array(feat), cache)
        block = _block(drafter, anchor)
        walk = drafter.draft_walk(block, cache)
        prevs = [anchor] + [int(t) for t in ref[f"drafts{step}"][:-1]]
        rows = np.stack([np.array(walk.draft_row(i, mx.array(p))) for i, p in enumerate(prevs)])
        np.testing.assert_allclose(rows, ref[f"rows{step}"], atol=TOL, rtol=TOL)
        assert np.array(drafter.greedy_draft(block, cache))[0].tolist() == ref[f"drafts{step}"].tolist()
        if f"confidence{step}" in ref:
            np.testing.assert_allclose(np.array(walk.confidence()), ref[f"confidence{step}"], atol=TOL)
        else:
            assert walk.confidence() is None


@pytest.mark.parametrize("name", make_dspark.ACCEPTANCE)
def test_acceptance_per_pass_matches_the_reference(name, checkpoints):
    ref = np.load(FIXTURES / f"{name}.npz")
    drafter = load_drafter(checkpoints[name])
    t = prepare(tiny.target("qwen3"), drafter)  # binds the target's head where the drafter has none
    prompt = tiny.prompt_ids(12)
    tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=len(ref["tokens"]))
    assert tokens == tiny.reference("qwen3", prompt, len(tokens)) == ref["tokens"].tolist()
    got = [c.accepted for c in cycles[1:]]
    # The last pass may be narrower (the token budget): compare every full-width pass.
    assert got[:-1] == ref["accepted"].tolist()[: len(got) - 1] and sum(got) > 10


def _random_dspark(model, block=7, logits_start=0, seed=1, **kw):
    n = tiny.num_layers(model)
    values = dict(hidden_size=tiny.HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=model.args.vocab_size, rope_theta=10000.0,
                  target_layer_ids=sorted({min(1, n - 1), n - 1}), mask_token_id=model.args.vocab_size - 1,
                  dspark_block=block, logits_start=logits_start, block_size=block + 1 - logits_start,
                  markov_rank=8, enable_confidence_head=True)
    cfg = DSparkConfig(**dict(values, **kw))
    drafter = tiny.randomize(DSparkDrafter(cfg), seed)
    return drafter, TargetModel(model, cfg.target_layer_ids)


@pytest.mark.parametrize("kind", tiny.CORE_KINDS + ("qwen3_tied",))
@pytest.mark.parametrize("block,logits_start,width", [(7, 0, 8), (7, 0, 3), (4, 1, 4), (9, 0, 10)])
def test_greedy_output_is_plain_greedy(kind, block, logits_start, width):
    drafter, t = _random_dspark(tiny.target(kind), block, logits_start)
    prompt = tiny.prompt_ids(10, seed=2)
    tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=24, width=width)
    assert tokens == tiny.reference(kind, prompt, 24)
    assert max(c.width for c in cycles) == width


VARIANTS = {
    # Causal block, a window shorter than the prompt, sinks, the target's head, a pure anchor slot.
    "nemotron": (8, 1, dict(is_causal=True, sliding_window=8, layer_types=["sliding_attention"] * 2,
                            attention_sink=True, has_own_lm_head=False, enable_confidence_head=False)),
    "gemma4": (7, 0, dict(backbone="gemma4", attention_k_eq_v=True, head_dim=32, num_key_value_heads=1,
                          rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                          final_logit_softcapping=30.0)),
}


@pytest.mark.parametrize("kind", tiny.CORE_KINDS + ("qwen3_tied",))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("width", [8, 3])
def test_variant_greedy_output_is_plain_greedy(kind, variant, width):
    model = tiny.target(kind)
    block, start, kw = VARIANTS[variant]
    drafter, _ = _random_dspark(model, block, start, **kw)
    assert ("lm_head" not in drafter and drafter.causal_block) if variant == "nemotron" else not drafter.causal_block
    t = prepare(model, drafter)
    prompt = tiny.prompt_ids(10, seed=2)
    tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=24, width=width)
    assert tokens == tiny.reference(kind, prompt, 24)
    assert max(c.width for c in cycles) == width


def test_causal_block_runs_only_the_slots_it_reads(checkpoints):
    """A causal block stops after the last slot read; that changes no draft row (what makes it worth doing)."""
    drafter = _bind_if_borrowing(load_drafter(checkpoints["nemotron"]))
    cache = drafter.make_cache()
    drafter.append_context(mx.array(make_dspark.features()[0]), cache)
    full = drafter.slot_hidden(_block(drafter, 5), cache)
    short = drafter.slot_hidden(_block(drafter, 5)[:, :3], cache)
    np.testing.assert_allclose(np.array(short), np.array(full[:2]), atol=1e-5)


def test_nemotron_schemas_normalize_alike():
    """The Nemotron markers in DeepSpec's top-level spelling and in a nested `dflash_config` are one config."""
    top = dict(make_dspark.PACKAGINGS["nemotron"][0])
    nested = {k: v for k, v in top.items() if k not in ("dflash_query_causal", "sliding_window")}
    nested["dflash_config"] = dict(causal=True, use_swa=True, swa_window_size=8)
    a, b = DSparkConfig.from_dict(top), DSparkConfig.from_dict(nested)
    assert a.to_dict() == b.to_dict()
    assert (a.is_causal, a.sliding_window, a.attention_sink, a.has_own_lm_head, a.logits_start, a.block_size) == (
        True, 8, True, False, 1, 8)
    assert a.packaging == "nemotron" and DSparkConfig.from_dict(a.to_dict()) == a
    # A window a Qwen3 config copied from its target (no DFlash marker beside it) is not the drafter's.
    plain = DSparkConfig.from_dict(dict(make_dspark.PACKAGINGS["deepspec"][0], sliding_window=4096))
    assert plain.sliding_window is None and not plain.is_causal


def test_bigram_drafter_is_lossless_on_every_width(checkpoints):
    drafter = load_drafter(checkpoints["deepspec"])
    t = TargetModel(tiny.target("qwen3"), drafter.config.target_layer_ids)
    prompt = tiny.prompt_ids(12)
    for width in (2, 5, drafter.block_size):
        tokens, cycles = tiny.run_dflash(prompt, t, drafter, max_tokens=40, width=width)
        assert tokens == tiny.reference("qwen3", prompt, 40)
        assert sum(c.accepted for c in cycles) > 5


def test_markov_term_changes_the_proposal(checkpoints):
    drafter = load_drafter(checkpoints["specforge"])  # a random Markov head
    cache = drafter.make_cache()
    drafter.append_context(mx.array(make_dspark.features()[0]), cache)
    block = _block(drafter, make_dspark.ANCHORS[0])
    parallel = mx.argmax(drafter.draft_logits(drafter.slot_hidden(block, cache)), axis=-1)
    greedy = drafter.greedy_draft(block, cache)[0]
    assert not mx.array_equal(parallel, greedy)
    assert mx.array_equal(mx.argmax(drafter(block, cache)[0], axis=-1), greedy)  # __call__ = the greedy walk's rows


def test_width_beyond_the_drafts_is_one_clear_error(checkpoints):
    drafter = load_drafter(checkpoints["deepspec"])
    too_wide = mx.array([[1] + [drafter.mask_token_id] * drafter.block_size], dtype=mx.int32)
    with pytest.raises(DFlashError, match="at most 8"):
        drafter.greedy_draft(too_wide, drafter.make_cache())


# -- sampling: chi-square against the exact joint of the first three tokens -------------------------------------------
def _sampling_pair(block: int, confidence: bool):
    """A one-layer llama target over the chi-square vocabulary and a DSpark drafter whose strong Markov term makes
    the proposal for slot i depend on the token drawn at slot i-1."""
    from test_sampling import E2E_VOCAB

    model = tiny.build_target("llama", seed=3, num_hidden_layers=1, vocab_size=E2E_VOCAB)
    cfg = DSparkConfig(hidden_size=tiny.HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=96, vocab_size=E2E_VOCAB, rope_theta=10000.0,
                       target_layer_ids=[0], mask_token_id=E2E_VOCAB - 1, dspark_block=block - 1, logits_start=0,
                       block_size=block, markov_rank=E2E_VOCAB, enable_confidence_head=confidence)
    drafter = tiny.randomize(DSparkDrafter(cfg), 5)
    drafter.markov_head.markov_w1.weight = mx.eye(E2E_VOCAB) * 3.0
    return model, drafter, TargetModel(model, cfg.target_layer_ids)


def test_sampling_with_the_markov_walk_is_exact():
    from test_sampling import ALPHA, E2E_VOCAB, PROMPT, chi2_pvalue, exact_target_joint, joint_counts

    model, drafter, t = _sampling_pair(3, confidence=False)
    params = SamplingParams(temp=1.0)
    seqs, accepted = [], 0
    for seed in range(400):
        tokens, cycles = tiny.run_dflash(PROMPT, t, drafter, max_tokens=4, acceptor=SamplingAcceptor(params, seed=seed))
        seqs.append(tokens[:3])
        accepted += sum(c.accepted for c in cycles)
    assert chi2_pvalue(joint_counts(np.array(seqs), E2E_VOCAB), exact_target_joint(model, PROMPT, params)) > ALPHA
    assert accepted > 40


class _AlwaysDraft(WidthPolicy):
    """An adaptive policy that always asks for the widest block (so every pass drafts and the head cuts it), its
    pass costs measured up front (nominal ones) and every cut it makes kept in `cuts`."""

    def __init__(self, max_width):
        super().__init__(max_width, cost=nominal_cost)
        for w in range(1, max_width + 1):
            self.record(w, w - 1, 0.0)
        self.cuts = []

    def choose(self) -> int:
        return self.max_width

    def truncate(self, confidence, widest):
        self.cuts.append((list(confidence), widest, super().truncate(confidence, widest)))
        return self.cuts[-1][-1]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_tied"])
def test_confidence_cut_is_lossless_and_follows_the_head(kind):
    """With an adaptive width, a drafter with a confidence head drafts its widest block and the policy cuts it on
    the head's estimates: each pass's width is the policy's cut of that pass's estimates; output is plain greedy."""
    model = tiny.target(kind)
    drafter, _ = _random_dspark(model, 7, 0)
    recording = _RecordingDSpark(drafter.config)
    recording.update(drafter.parameters())
    recording.walks = []
    t = prepare(model, recording)
    prompt = tiny.prompt_ids(10, seed=4)
    policy = _AlwaysDraft(8)
    tokens, cycles = tiny.run_dflash(prompt, t, recording, max_tokens=40, planner=policy)
    assert tokens == tiny.reference(kind, prompt, 40)
    passes = [c for c in cycles if c.source == "dflash"]
    assert len(passes) == len(recording.walks) == len(policy.cuts) and recording.walks[0].length == 7
    for cycle, walk, (conf, drafted, cut) in zip(passes, recording.walks, policy.cuts):
        assert drafted == walk.length + 1 and cycle.width == cut
        np.testing.assert_allclose(conf, np.array(walk.confidence()), rtol=1e-6)
    assert len({c.width for c in passes}) >= 3  # the cut really moves


def test_sampling_with_the_confidence_cut_is_exact():
    """chi-square: blocks cut on a confidence head that depends strongly on the previous draft stay exact."""
    from test_sampling import ALPHA, E2E_VOCAB, PROMPT, chi2_pvalue, exact_target_joint, joint_counts

    model, drafter, t = _sampling_pair(4, confidence=True)
    # The head's estimate swings with the previous draft: a cut that looked at a slot's own draft would bias it.
    head = drafter.confidence_head.proj
    head.weight = mx.concatenate([mx.zeros((1, tiny.HIDDEN)), mx.array(np.linspace(-6, 6, E2E_VOCAB))[None]], axis=1)
    params = SamplingParams(temp=1.0)
    seqs, widths = [], set()
    for seed in range(400):
        tokens, cycles = tiny.run_dflash(PROMPT, t, drafter, max_tokens=4, acceptor=SamplingAcceptor(params, seed=seed),
                                         planner=_AlwaysDraft(4))
        seqs.append(tokens[:3])
        widths.add(cycles[1].width)  # the pass that decides tokens 2 and 3: cut after one draft, or not
    assert widths == {2, 3}
    assert chi2_pvalue(joint_counts(np.array(seqs), E2E_VOCAB), exact_target_joint(model, PROMPT, params)) > ALPHA


# -- conversion and loading -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepspec", "speculators", "gemma4", "nemotron"])
@pytest.mark.parametrize("bits,tolerance", [(4, 0.5), (8, 0.08)])
def test_quantized_conversion_round_trips(name, bits, tolerance, checkpoints, tmp_path):
    out = convert_drafter(str(checkpoints[name]), tmp_path / "q", dtype="float32", q_bits=bits, q_group_size=32)
    ref = _bind_if_borrowing(load_drafter(checkpoints[name]))
    got = _bind_if_borrowing(load_drafter(out))
    assert read_config(out).to_dict() == dict(ref.config.to_dict(), quantization={"group_size": 32, "bits": bits})
    assert isinstance(got.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # The Markov and confidence heads stay float: small and sensitive.
    assert type(got.markov_head.markov_w2) is nn.Linear and type(got.markov_head.markov_w1) is nn.Embedding
    assert name == "nemotron" or type(got.confidence_head.proj) is nn.Linear
    rows = []
    for d in (ref, got):
        cache = d.make_cache()
        d.append_context(mx.array(make_dspark.features()[0]), cache)
        rows.append(d.draft_logits(d.slot_hidden(_block(d, make_dspark.ANCHORS[0]), cache)))  # parallel part
    err = (mx.linalg.norm(rows[1] - rows[0]) / mx.linalg.norm(rows[0])).item()
    # The tiny random Gemma-4 head measures 0.61 at 4 bits (its sandwich norms re-scale each sublayer's error).
    assert 0 < err < tolerance * (1.5 if name == "gemma4" and bits == 4 else 1), err
    t = prepare(tiny.target("qwen3"), got)
    tokens, _ = tiny.run_dflash(tiny.prompt_ids(12), t, got, max_tokens=24)
    assert tokens == tiny.reference("qwen3", tiny.prompt_ids(12), 24)


def test_float_conversion_is_exact(checkpoints, tmp_path):
    out = convert_drafter(str(checkpoints["lfm2"]), tmp_path / "f", dtype="float32")
    a, b = load_drafter(checkpoints["lfm2"]), load_drafter(out)
    assert b.config.rope_traditional and b.config.packaging == "lfm2"
    for d in (a, b):
        d.cache = d.make_cache()
        d.append_context(mx.array(make_dspark.features()[0]), d.cache)
    block = _block(a, 3)
    assert mx.array_equal(a(block, a.cache), b(block, b.cache))


BAD = [
    ("deepspec", {"model_type": "qwen3_5"}, "model_type"),
    ("gemma4", {"attention_sink_bias": True}, "attention_sink_bias"),
    ("nemotron", {"sliding_window": 4}, "sliding_window"),
    ("deepspec", {"log_snr_conditioning": True}, "log_snr_conditioning"),
    ("deepspec", {"markov_head_type": "gated"}, "markov_head_type"),
    ("deepspec", {"block_size": None, "dspark_num_layers": 1}, "dspark_num_layers"),
    ("deepspec", {"logits_start": 3}, "logits_start"),
    ("deepspec", {"mask_token_id": None}, "mask_token_id"),
    ("speculators", {"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids"),
]


@pytest.mark.parametrize("name,change,key", BAD)
def test_bad_configs_are_one_line_naming_the_key(name, change, key, tmp_path):
    path = make_dspark.write_checkpoint(tmp_path / name, name)
    raw = json.loads((path / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError) as e:
        load_drafter(path)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_missing_d2t_is_refused(checkpoints, tmp_path):
    import shutil

    path = tmp_path / "nod2t"
    shutil.copytree(checkpoints["speculators"], path)
    weights = dict(mx.load(str(path / "model.safetensors")))
    del weights["d2t"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(DFlashError, match="d2t"):
        load_drafter(path)


# -- end to end through the public API --------------------------------------------------------------------------------
class _RecordingDSpark(DSparkDrafter):
    """Keeps every walk the engine drafts from, to read their confidences afterwards."""

    def draft_walk(self, block_ids, cache):
        walk = super().draft_walk(block_ids, cache)
        self.walks.append(walk)
        return walk


def test_stream_generate_with_a_dspark_drafter_is_plain_and_exposes_confidence(tmp_path):
    from dflash_mlx import api
    from dflash_mlx.demo import make_tiny_pair

    target_dir, _ = make_tiny_pair(tmp_path)
    model, tokenizer = load_target(str(target_dir))
    ids = tokenizer.encode("Hello there")
    plain = [r.token for r in api.stream_generate(model, tokenizer, ids, None, max_tokens=40)]
    V, n = model.args.vocab_size, tiny.num_layers(model)
    cfg = DSparkConfig(hidden_size=model.args.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=V, rope_theta=10000.0,
                       target_layer_ids=[1, n - 2], mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
                       dspark_block=7, logits_start=0, block_size=8, markov_rank=V, enable_confidence_head=True)
    drafter = tiny.randomize(_RecordingDSpark(cfg), 4)
    # A Markov head that follows the plain continuation's bigrams, so drafts are accepted and wide passes happen.
    w2 = np.zeros((V, V), dtype=np.float32)
    for a, b in zip(list(ids) + plain, plain):
        w2[b, a] = 0.0 if w2[:, a].any() else 12.0
    drafter.markov_head.markov_w1.weight = mx.eye(V)
    drafter.markov_head.markov_w2.weight = mx.array(w2)
    for block_size in (None, 5):
        drafter.walks = []
        out = list(api.stream_generate(model, tokenizer, ids, drafter, max_tokens=40, width=block_size,
                                       lookup=False))
        assert [r.token for r in out] == plain and len(plain) == 40
        assert sum(r.accepted for r in out if r.source == "dflash") > 10 and out[-1].tau > 1.5
        assert drafter.walks and max(w.length for w in drafter.walks) == (block_size or 8) - 1
        for walk in drafter.walks:
            assert walk.has_confidence
            conf = np.array(walk.confidence())
            assert conf.shape == (walk.length,) and ((conf > 0) & (conf < 1)).all()
