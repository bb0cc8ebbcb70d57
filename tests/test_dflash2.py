"""DFlash 2 drafters: parity with z-lab's MLX reference, losslessness, exact sampling, conversion and bad input.

Parity fixtures (tests/fixtures/dflash2/, written by tests/fixtures/make_dflash2.py from z-lab's `dflash` package)
hold tiny random checkpoints in the published packaging and what the reference computed from them: two
consecutive cached drafting steps (head logits, greedy selector path, sampled proposal rows q) and, for the
published-style variant, the per-pass acceptance lengths of the reference's own greedy loop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny
from dflash_mlx.decode.acceptance import SamplingAcceptor
from dflash_mlx.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_mlx.drafters.dflash import TargetBinding
from dflash_mlx.drafters.families import describe
from dflash_mlx.drafters.io import load_drafter, quantize_drafter, read_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import TargetModel

FIXTURES = Path(__file__).parent / "fixtures" / "dflash2"
VARIANTS = ("published", "published_w64", "causal_default", "causal_true")
TOL = 1e-4


def _expected(name):
    data = np.load(FIXTURES / name / "expected.npz")
    return {k: data[k] for k in data.files}, json.loads((FIXTURES / name / "expected.json").read_text())


def _bind_arrays(drafter, embed, head):
    E, W = mx.array(embed), mx.array(head)
    return drafter.bind(TargetBinding(lambda ids: E[ids], lambda h: h @ W.T))


def make_dflash2(model, *, block_size=4, is_causal=None, layer_types=None, seed=1, **overrides):
    """A random DFlash 2 drafter bound to a tiny target, and the tapped TargetModel."""
    n = tiny.num_layers(model)
    vocab = model.args.vocab_size
    values = dict(hidden_size=tiny.HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=vocab, head_dim=16, rope_theta=10000.0, num_target_layers=n,
                  block_size=block_size, target_layer_ids=sorted({min(1, n - 1), n - 1}), mask_token_id=vocab - 1,
                  is_causal=is_causal, layer_types=layer_types, sliding_window=6 if layer_types else None,
                  conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=min(5, vocab))
    values.update(overrides)
    drafter = tiny.randomize(DFlash2Drafter(DFlash2Config(**values)), seed)
    t = TargetModel(model, drafter.config.target_layer_ids)
    drafter.bind(TargetBinding(t.embed, t.head))
    return drafter, t


# -- parity with the reference ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", VARIANTS)
def test_two_cached_steps_match_the_reference(name):
    exp, _ = _expected(name)
    drafter = _bind_arrays(read_drafter(FIXTURES / name), exp["target.embed"], exp["target.head"])
    assert describe(drafter).startswith("DFlash 2 drafter")
    cache = drafter.make_cache()
    for step in (1, 2):
        s = lambda key: exp[f"step{step}.{key}"]  # noqa: E731
        block = mx.array(s("block"))
        drafter.append_context(mx.array(s("features")), cache)
        logits = drafter.draft_logits(drafter.hidden_states(block, cache)[0])
        np.testing.assert_allclose(np.array(logits), s("logits"), atol=TOL, rtol=TOL)
        walk = drafter.draft_walk(block, cache)
        assert sorted(map(sorted, np.array(walk.candidates).tolist())) == sorted(map(sorted, s("candidates").tolist()))
        assert np.array(drafter.greedy_draft(block, cache))[0].tolist() == s("greedy_path").tolist()
        assert np.array(mx.argmax(drafter(block, cache), axis=-1))[0].tolist() == s("greedy_path").tolist()
        # At temperature 1 the reference draws slot i from q_i = softmax(scores | its own draw at i-1); our row for
        # the same predecessor, as a distribution, must put exactly q_i on the same candidates and 0 elsewhere.
        prev = int(block[0, 0].item())
        for i, token in enumerate(s("sampled_path").tolist()):
            probs = np.array(mx.softmax(walk.row(i, mx.array(prev, dtype=mx.int32)), axis=-1))
            np.testing.assert_allclose(probs[s("sampled_candidates")[i]], s("q")[i], atol=TOL)
            assert probs.sum() == pytest.approx(probs[s("sampled_candidates")[i]].sum(), abs=1e-6)
            prev = token


def test_acceptance_sequence_matches_the_reference():
    exp, meta = _expected("published_w64")
    model = tiny.build_target(meta["target_kind"], meta["target_seed"])
    checksum = sum(float(mx.sum(mx.abs(v)).item()) for _, v in tree_flatten(model.parameters()))
    assert checksum == pytest.approx(meta["target_checksum"], rel=1e-6), "tiny.py's target changed: regenerate"
    model.lm_head.weight = mx.array(exp["target.head"])  # the steered head the reference ran with
    drafter = read_drafter(FIXTURES / "published_w64")
    t = TargetModel(model, drafter.config.target_layer_ids)
    drafter.bind(TargetBinding(t.embed, t.head))
    tokens, cycles = tiny.run_dflash(meta["prompt"], t, drafter, max_tokens=meta["max_tokens"])
    assert tokens == meta["tokens"] == tiny.greedy(model, meta["prompt"], meta["max_tokens"])
    passes = [len(c.tokens) for c in cycles if not c.is_prefill]
    assert passes == meta["passes"]
    assert max(passes) > 2  # drafts were accepted: the sequence says something


# -- greedy losslessness --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,block", [(k, 8) for k in tiny.CORE_KINDS] + [("qwen3", 2), ("llama_swa", 4)])
def test_greedy_equals_plain_decoding(kind, block):
    drafter, t = make_dflash2(tiny.target(kind), block_size=block)
    prompt = tiny.prompt_ids(9, seed=2)
    tokens, _ = tiny.run_dflash(prompt, t, drafter, max_tokens=24)
    assert tokens == tiny.reference(kind, prompt, 24)


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_greedy_lossless_with_sliding_layers_either_way(is_causal):
    drafter, t = make_dflash2(tiny.target("llama"), block_size=8, is_causal=is_causal,
                              layer_types=["sliding_attention", "full_attention"])
    assert drafter.layers[0].self_attn.block_causal is (True if is_causal is None else is_causal)
    assert drafter.layers[1].self_attn.block_causal is bool(is_causal)
    prompt = tiny.prompt_ids(11, seed=4)
    tokens, _ = tiny.run_dflash(prompt, t, drafter, max_tokens=20)
    assert tokens == tiny.reference("llama", prompt, 20)


def test_anchor_has_no_predecessor_in_the_convolution():
    """Changing only the anchor's embedding row may change every slot, but changing the context must not leak into
    the convolution: the conv of row 0 sees zeros, so a block of one row is the sublayer of that row alone."""
    drafter, _ = make_dflash2(tiny.target("qwen3"))
    conv = drafter.layers[0].attention_conv
    x = mx.random.normal((1, 3, tiny.HIDDEN), key=mx.random.key(0))
    full, _ = conv.prepare(x)
    alone, _ = conv.prepare(x[:, :1])
    np.testing.assert_allclose(np.array(full[:, :1]), np.array(alone), atol=1e-6)
    shifted, _ = conv.prepare(mx.concatenate([mx.zeros_like(x[:, :1]) + 5.0, x[:, 1:]], axis=1))
    assert not np.allclose(np.array(shifted[:, 1]), np.array(full[:, 1]))  # row 1 does read row 0


# -- exact sampling ---------------------------------------------------------------------------------------------------
def test_sampling_with_the_selector_is_exact():
    from test_sampling import (ALPHA, E2E_BLOCK, E2E_VOCAB, FILTERS, PROMPT, chi2_pvalue, exact_target_joint,
                               joint_counts)

    model = tiny.build_target("llama", seed=3, num_hidden_layers=1, vocab_size=E2E_VOCAB)
    drafter, t = make_dflash2(model, block_size=E2E_BLOCK, num_hidden_layers=1, target_layer_ids=[0],
                              selector_top_k=3, conv_group_size=32)
    seqs, accepted = [], 0
    for params_name in ("plain", "topk_topp"):
        params = FILTERS[params_name]
        seqs = []
        for seed in range(300):
            tokens, cycles = tiny.run_dflash(PROMPT, t, drafter, max_tokens=4,
                                             acceptor=SamplingAcceptor(params, (), seed=seed))
            seqs.append(tokens[:3])
            accepted += sum(c.accepted for c in cycles)
        assert chi2_pvalue(joint_counts(np.array(seqs), E2E_VOCAB),
                           exact_target_joint(model, PROMPT, params)) > ALPHA, params_name
    assert accepted > 50  # the selector's drafts were accepted often enough to matter


def test_walk_rows_are_k_sparse():
    drafter, t = make_dflash2(tiny.target("qwen3"), block_size=4, selector_top_k=3)
    cache = drafter.make_cache()
    drafter.append_context(mx.random.normal((1, 5, 2 * tiny.HIDDEN), key=mx.random.key(1)), cache)
    walk = drafter.draft_walk(mx.array([[3, 96, 96, 96]]), cache)
    row = np.array(walk.row(0, mx.array(3)))
    assert np.isfinite(row).sum() == 3 and set(np.flatnonzero(np.isfinite(row))) == set(np.array(walk.candidates[0]))


# -- conversion -------------------------------------------------------------------------------------------------------
def _logits(drafter, exp):
    _bind_arrays(drafter, exp["target.embed"], exp["target.head"])
    cache = drafter.make_cache()
    drafter.append_context(mx.array(exp["step1.features"]), cache)
    return np.array(drafter.draft_logits(drafter.hidden_states(mx.array(exp["step1.block"]), cache)[0]))


def test_convert_float_round_trip(tmp_path):
    from convert.drafter import convert_drafter

    exp, _ = _expected("published")
    out = convert_drafter(str(FIXTURES / "published"), tmp_path / "f32", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 5
    assert cfg["is_causal"] is False and cfg["dflash_config"]["output_multiplier"] == pytest.approx(0.196116135)
    again = load_drafter(out)
    assert type(again) is DFlash2Drafter
    np.testing.assert_allclose(_logits(again, exp), exp["step1.logits"], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_conversion_keeps_conv_and_selector_in_bf16(tmp_path, bits):
    from convert.drafter import convert_drafter

    exp, _ = _expected("published")
    out = convert_drafter(str(FIXTURES / "published"), tmp_path / f"q{bits}", q_bits=bits, q_group_size=32)
    drafter = load_drafter(out)
    assert drafter.config.quantization == {"group_size": 32, "bits": bits}
    assert isinstance(drafter.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    kept = [drafter.layers[0].attention_conv.kernel_projection, drafter.layers[1].mlp_conv.kernel_projection,
            drafter.candidate_selector.hidden_projection, drafter.candidate_selector.predecessor_codebook,
            drafter.candidate_selector.successor_codebook]
    assert all(type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.bfloat16 for m in kept)
    assert drafter.layers[0].attention_conv.base_kernel.dtype == mx.bfloat16
    # Round trip: what was written and read back is exactly the drafter quantized in memory.
    direct = read_drafter(FIXTURES / "published")
    direct.set_dtype(mx.bfloat16)
    quantize_drafter(direct, bits, 32)
    got = _logits(drafter, exp)
    np.testing.assert_array_equal(got, _logits(direct, exp))
    if bits == 8:  # and close to the float drafter (4 bits on random 64-wide weights is too coarse to bound)
        assert np.abs(got - exp["step1.logits"]).max() < 0.05 * np.abs(exp["step1.logits"]).max()
    # The quantized drafter loaded in its fastest CPU form decodes losslessly like any other.
    fast = load_drafter(out, fastest=True)
    assert "converted to float32" in fast.weights_form
    model = tiny.target("qwen3")
    t = TargetModel(model, fast.config.target_layer_ids)
    fast.bind(TargetBinding(t.embed, t.head))
    prompt = tiny.prompt_ids(8, seed=5)
    assert tiny.run_dflash(prompt, t, fast, max_tokens=12)[0] == tiny.reference("qwen3", prompt, 12)


# -- bad input ---------------------------------------------------------------------------------------------------------
def _copy(tmp_path, edit=None, tensors=None):
    folder = tmp_path / "d"
    shutil.copytree(FIXTURES / "published", folder)
    if edit:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors:
        weights = mx.load(str(folder / "model.safetensors"))
        tensors(weights)
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c["dflash_config"].pop("selector_top_k"), "dflash_config.selector_top_k"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "dflash_config.conv_kernel_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(selector_rank=0), "dflash_config.selector_rank"),
])
def test_inconsistent_config_is_one_error_naming_the_key(tmp_path, edit, needle):
    with pytest.raises(DFlashError) as e:
        read_drafter(_copy(tmp_path, edit))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_dflash1_config_with_dflash2_tensors_names_the_tensor(tmp_path):
    def to_dflash1(c):
        c["architectures"] = ["DFlashDraftModel"]
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            c["dflash_config"].pop(key)

    with pytest.raises(DFlashError) as e:
        read_drafter(_copy(tmp_path, to_dflash1))
    assert "candidate_selector" in str(e.value) and "DFlash 2" in str(e.value) and "\n" not in str(e.value)


def test_missing_selector_tensor_is_named(tmp_path):
    folder = _copy(tmp_path, tensors=lambda w: w.pop("candidate_selector.successor_codebook"))
    with pytest.raises(DFlashError, match="candidate_selector.successor_codebook"):
        read_drafter(folder)


# -- registry ------------------------------------------------------------------------------------------------------------
def test_registry_names_dflash2_pairs_whose_targets_mlx_lm_loads():
    from dflash_mlx.models import registry

    for name, drafter in (("Qwen3.8-27B", "incoai/Qwen3.8-27B-DFlash2"),
                          ("Muse-Glimmer-30B", "z-lab/Muse-Glimmer-30B-DFlash2")):
        entry = registry.find(name)
        assert entry.drafter == drafter and registry.mlx_lm_supports(entry.architecture)
        assert registry.resolve(name).target == entry.targets["4bit"]


def test_registry_says_in_one_line_when_mlx_lm_lacks_the_target_architecture(monkeypatch):
    import dataclasses

    from dflash_mlx.models import registry

    real = registry.entries()
    fake = dict(real, **{"Qwen3.8-27B": dataclasses.replace(real["Qwen3.8-27B"], architecture="no_such_arch")})
    monkeypatch.setattr(registry, "entries", lambda: fake)
    with pytest.raises(DFlashError) as e:
        registry.resolve("Qwen3.8-27B")
    assert "'no_such_arch'" in str(e.value) and "mlx-lm" in str(e.value) and "\n" not in str(e.value)
    assert registry.mlx_lm_supports("mistral")  # mlx-lm's own renames count (mistral runs llama's module)
