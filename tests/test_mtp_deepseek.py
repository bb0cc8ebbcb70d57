"""MTP layers in the DeepSeek-V3 layout (dflash_mlx/drafters/mtp_deepseek.py) for deepseek_v3 / kimi_k25 targets.

A tiny random fp32 deepseek_v3 checkpoint whose MTP layer is `model.layers.{N}.*` in the Hugging Face layout
(per-expert tensors, fused `kv_b_proj`; benchmarks/mtp_reference.py builds it). Checked: greedy output equals plain
greedy decoding at 1, 2 and 3 drafts, drafts both accepted and rejected, with the target's or the layer's own
embedding and head; the MTP block equals the reference implementation's block (mlx-vlm, recorded in
tests/fixtures/mtp/deepseek_v3/block.safetensors) on the same weights and inputs; sharded and 8-bit MLX-layout
checkpoints load; a checkpoint without the layer is one line.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from benchmarks.mtp_reference import (DEEPSEEK_FIXTURE, DEEPSEEK_PREFILL, MAX_TOKENS, PROMPT, build_deepseek,
                                      generate_plain, load_deepseek_target, save_deepseek_checkpoint)
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.proposers.mtp import MTPProposer
from dflash_mlx.decode.step import drafting_proposer
from dflash_mlx.drafters import mtp as mtp_module
from dflash_mlx.drafters.dflash import TargetBinding
from dflash_mlx.drafters.mtp import load_mtp_drafter
from dflash_mlx.drafters.mtp_deepseek import DeepseekMTPDrafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import build_target


def prepare(model, drafter):
    """What `models.loading.prepare` does for a drafter: tap its layer, bind the target's embedding and head."""
    target = build_target(model, drafter.config.target_layer_ids)
    drafter.bind(TargetBinding(target.embed, functools.partial(target.head, softcap=False), None, source=target))
    return target


def loaded(folder):
    model = load_deepseek_target(folder)
    drafter = load_mtp_drafter(folder, model)
    return model, drafter, prepare(model, drafter)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    folder = save_deepseek_checkpoint(tmp_path_factory.mktemp("ds") / "deepseek_v3")
    return (folder, *loaded(folder))


def decode(target, drafter, drafts, max_tokens=MAX_TOKENS, **kw):
    passes = list(Generation(target, drafter, PROMPT, max_tokens=max_tokens, width=drafts + 1, lookup=False, **kw))
    return [t for p in passes for t in p.tokens], passes[1:]


def test_greedy_equals_plain_decoding(ds):
    folder, model, drafter, target = ds
    assert isinstance(drafter, DeepseekMTPDrafter) and drafter.config.target_layer_ids == [2]
    assert "embed_tokens" not in drafter and "head" not in drafter.shared_head  # the target's are borrowed
    proposer = drafting_proposer(drafter)
    assert isinstance(proposer, MTPProposer) and proposer.widest == drafter.block_size
    expected = generate_plain(model, PROMPT, MAX_TOKENS)
    for k in (1, 2, 3):
        tokens, passes = decode(target, drafter, k)
        assert tokens == expected, k
        drafted = [p for p in passes if p.width > 1]
        assert drafted and all(p.source == "mtp" for p in drafted)
        assert any(p.accepted > 0 for p in drafted) and any(p.accepted < p.width - 1 for p in drafted), k
    assert decode(target, drafter, 3, prefill_step_size=4)[0] == expected  # the prompt's pairs run chunk by chunk


def test_the_layers_own_embedding_and_head_are_used(tmp_path, ds):
    folder = save_deepseek_checkpoint(tmp_path / "own", own_embed=True, own_head=True)
    model, drafter, target = loaded(folder)
    assert isinstance(drafter.embed_tokens, nn.Embedding) and isinstance(drafter.shared_head.head, nn.Linear)
    # (they are copies of the target's: the same drafts as with the borrowed ones)
    borrowed = decode(ds[3], ds[2], 2, max_tokens=24)
    tokens, passes = decode(target, drafter, 2, max_tokens=24)
    assert tokens == generate_plain(model, PROMPT, 24) == borrowed[0]
    assert [p.accepted for p in passes] == [p.accepted for p in borrowed[1]]


def test_the_block_equals_the_reference(ds):
    """(target's final-normed hidden at t, token t+1) -> MTP output, against the reference's block on the same
    checkpoint: a prefill of DEEPSEEK_PREFILL positions, then one position per call (the KV cache's path)."""
    folder, model, drafter, target = ds
    ref = mx.load(str(DEEPSEEK_FIXTURE))
    tokens, hidden = ref["tokens"], ref["hidden"]
    assert tokens[0].tolist() == (PROMPT + generate_plain(model, PROMPT, MAX_TOKENS))[1:]
    np.testing.assert_allclose(np.array(model.model(mx.concatenate([mx.array([PROMPT[:1]]), tokens], 1))[:, :-1]),
                               np.array(hidden), atol=1e-5)  # the same target, the same inputs
    cache = drafter.make_cache()
    P = DEEPSEEK_PREFILL
    outs = [drafter.forward(tokens[:, :P], hidden[:, :P], cache)]
    outs += [drafter.forward(tokens[:, t : t + 1], hidden[:, t : t + 1], cache) for t in range(P, tokens.shape[1])]
    out = mx.concatenate(outs, axis=1)
    np.testing.assert_allclose(np.array(out), np.array(ref["out"]), atol=2e-5, rtol=1e-4)
    assert mx.argmax(drafter.logits(out), axis=-1).tolist() == ref["argmax"].tolist()
    # The tap the drafter is fed in decoding is the same final-normed hidden state.
    _, tapped = target(mx.concatenate([mx.array([PROMPT[:1]]), tokens], 1))
    np.testing.assert_allclose(np.array(drafter.target.norm(tapped[:, :-1])), np.array(hidden), atol=1e-5)


def test_a_sharded_checkpoint_reads_only_the_mtp_shard(tmp_path, ds, monkeypatch):
    folder = save_deepseek_checkpoint(tmp_path / "sharded", shards=3)
    read = []
    original = mtp_module._read
    monkeypatch.setattr(mtp_module, "_read", lambda path, keys: read.append(path.name) or original(path, keys))
    import dflash_mlx.drafters.mtp_deepseek as mtp_deepseek

    monkeypatch.setattr(mtp_deepseek, "_read", mtp_module._read)
    drafter = load_mtp_drafter(folder)
    assert read == ["model-00003-of-00003.safetensors"]
    whole = dict(tree_flatten(ds[2].parameters()))
    assert set(whole) == {k for k, _ in tree_flatten(drafter.parameters())}
    for name, value in tree_flatten(drafter.parameters()):
        assert mx.array_equal(value, whole[name]).item(), name


def test_a_kimi_k25_checkpoint_nests_the_same_layer(tmp_path, ds):
    """Kimi K2.5's layout: the text model under `language_model.`, its config under `text_config`."""
    folder0, model0, drafter0, _ = ds
    folder = tmp_path / "kimi"
    folder.mkdir()
    weights = mx.load(str(folder0 / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {"language_model." + k: v for k, v in weights.items()},
                        metadata={"format": "pt"})
    text = json.loads((folder0 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    model, drafter, target = loaded(folder)
    assert drafter.config.model_type == "kimi_k25" and drafter.target.norm is model.language_model.model.norm
    theirs = dict(tree_flatten(drafter.parameters()))
    for name, value in tree_flatten(drafter0.parameters()):
        assert mx.array_equal(value, theirs[name]).item(), name
    assert decode(target, drafter, 2, max_tokens=20)[0] == generate_plain(model0, PROMPT, 20)


def test_a_quantized_mlx_checkpoint_loads_and_stays_lossless(tmp_path, ds):
    """MLX layout (experts stacked, `kv_b_proj` split), the MTP layer's linear layers 8-bit, in `.scales` form."""
    folder0, model, drafter0, _ = ds
    quantized = load_mtp_drafter(folder0)
    nn.quantize(quantized, group_size=32, bits=8,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    N = drafter0.config.num_target_layers
    weights = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(quantized.parameters()):
        weights[f"model.layers.{N}." + (k[len("layers.0."):] if k.startswith("layers.0.") else k)] = v
    folder = tmp_path / "q8"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((folder0 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization={"group_size": 32, "bits": 8})))
    model2, drafter, target = loaded(folder)
    assert isinstance(drafter.eh_proj, nn.QuantizedLinear)
    theirs = dict(tree_flatten(drafter.parameters()))
    for name, value in tree_flatten(quantized.parameters()):
        assert mx.array_equal(value, theirs[name]).item(), name
    tokens, passes = decode(target, drafter, 3, max_tokens=20)
    assert tokens == generate_plain(model2, PROMPT, 20) and any(p.accepted for p in passes)


def test_a_checkpoint_without_the_layer_is_one_line(tmp_path):
    bare = save_deepseek_checkpoint(tmp_path / "bare", with_mtp=False)
    zero = save_deepseek_checkpoint(tmp_path / "zero")  # the tensors, but a config that declares none
    config = json.loads((zero / "config.json").read_text())
    (zero / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": config}))
    for folder in (bare, zero, kimi):
        with pytest.raises(DFlashError, match=r"has no MTP layers \(model\.layers\.3\.\* tensors\); use a DFlash"
                           ) as e:
            load_mtp_drafter(folder)
        assert "\n" not in str(e.value)


def test_builder_is_deterministic():
    a, b = build_deepseek()[2], build_deepseek()[2]
    assert all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(tree_flatten(a.parameters()),
                                                                     tree_flatten(b.parameters())))


@pytest.fixture(scope="module")
def real_depth(tmp_path_factory):
    """A tiny checkpoint at DeepSeek-V3's own depth (61 layers, the MTP layer as layer 61, which mlx-lm's loader
    drops), with a tokenizer: mlx-lm loads it as it is, so the front ends run unchanged."""
    import shutil

    from transformers import AutoTokenizer

    from dflash_mlx.demo import make_tiny_pair

    root = tmp_path_factory.mktemp("ds61")
    target_dir, _ = make_tiny_pair(root / "pair")
    vocab = len(AutoTokenizer.from_pretrained(str(target_dir)))
    folder = save_deepseek_checkpoint(root / "ds61", seed=0, vocab_size=vocab, num_hidden_layers=61,
                                      first_k_dense_replace=61)  # dense target layers, a MoE MTP layer
    for f in target_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


def test_load_and_the_command_line_with_draft_mtp(real_depth, capsys):
    from mlx_lm.generate import generate_step

    from dflash_mlx import load, stream_generate
    from dflash_mlx.cli import main

    model, tokenizer, drafter = load(str(real_depth), drafter="mtp")
    assert isinstance(drafter, DeepseekMTPDrafter) and drafter.config.target_layer_ids == [60]
    ids = tokenizer.encode("def add(a, b):")
    want = [int(t) for t, _ in generate_step(mx.array(ids, dtype=mx.int32), model, max_tokens=16)]
    for width in (None, 2, 4):
        got = [r for r in stream_generate(model, tokenizer, ids, drafter, max_tokens=16, width=width, lookup=False)]
        assert [r.token for r in got] == want, width
        assert "mtp" in {r.source for r in got}
    out = []
    for block in ("1", "3"):
        assert main(["generate", "--model", str(real_depth), "--draft", "mtp", "-p", "hello", "--max-tokens", "12",
                     "--ignore-chat-template", "--width", block]) == 0
        out.append(capsys.readouterr().out)
    assert out[0] == out[1]
