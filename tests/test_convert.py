"""Drafter conversion and loading: synthetic z-lab checkpoints in every config generation, written in tmp_path.

The z-lab key and shape table is spelled out here from docs/algorithm.md, independently of the code
under test. The reference drafter is built directly from the same arrays; converted and loaded drafters must give
the same logits (exactly in the same dtype, closely when quantized).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.convert.drafter import convert_drafter
from dflash_mlx.drafters.dflash import DFlashDrafter, TargetBinding
from dflash_mlx.drafters.io import load_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.targets import TargetModel

H, N_LAYERS, N_HEADS, N_KV, HEAD_DIM, INTER, VOCAB = 64, 2, 4, 2, 16, 96, 97
TAPS, MASK = [1, 2], 96

BASE = {
    "model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": H,
    "num_hidden_layers": N_LAYERS, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV,
    "head_dim": HEAD_DIM, "intermediate_size": INTER, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "attention_bias": False, "num_target_layers": 4, "torch_dtype": "bfloat16",
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
GENERATIONS = {
    # Older checkpoints: block_size and rope_theta at the top level.
    "old": {**BASE, "block_size": 4, "rope_theta": 10000.0,
            "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": MASK}},
    # Newer (transformers 5) checkpoints: block_size inside dflash_config, rope_parameters.
    "new": {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "dflash_config": {"block_size": 4, "target_layer_ids": TAPS, "mask_token_id": MASK}},
    "yarn": {**BASE, "block_size": 4, "rope_theta": 10000.0, "rope_scaling": YARN,
             "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": MASK}},
    "yarn_params": {**BASE, "rope_parameters": {**YARN, "rope_theta": 10000.0},
                    "dflash_config": {"block_size": 4, "target_layer_ids": TAPS, "mask_token_id": MASK}},
}


def zlab_shapes():
    n = len(TAPS)
    shapes = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (N_HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": (N_KV * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": (N_KV * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": (H, N_HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTER, H),
            p + "mlp.up_proj.weight": (INTER, H),
            p + "mlp.down_proj.weight": (H, INTER),
        })
    return shapes


def zlab_weights(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in zlab_shapes().items():
        if len(shape) == 1:  # norms near 1, so they still matter
            out[key] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[key] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return out


def write_checkpoint(path: Path, config: dict, weights: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def reference_drafter(config: dict, weights: dict, dtype=mx.float32) -> DFlashDrafter:
    drafter = DFlashDrafter(DFlashConfig.from_dict(config))
    drafter.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    return drafter


@pytest.fixture(scope="module")
def target():
    mx.random.seed(0)
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=H, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=512, head_dim=16,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return TargetModel(model, TAPS)


def draft_logits(drafter: DFlashDrafter, target: TargetModel) -> mx.array:
    """Two context appends (so RoPE offsets matter), then one block."""
    drafter.bind(TargetBinding(target.embed, target.head))
    _, hidden = target(mx.array([[1, 5, 7, 9, 22, 3]], dtype=mx.int32))
    cache = drafter.make_cache()
    drafter.append_context(hidden[:, :4], cache)
    drafter.append_context(hidden[:, 4:], cache)
    logits = drafter(mx.array([[3, MASK, MASK, MASK]], dtype=mx.int32), cache).astype(mx.float32)
    mx.eval(logits)
    return logits


def raises(fn, *fragments):
    with pytest.raises(DFlashError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def zlab(tmp_path):
    weights = zlab_weights()
    return write_checkpoint(tmp_path / "zlab", GENERATIONS["old"], weights), weights


# -- round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_convert_and_load_match_direct_drafter(generation, tmp_path, target):
    raw, weights = GENERATIONS[generation], zlab_weights()
    src = write_checkpoint(tmp_path / "zlab", raw, weights)
    expected = draft_logits(reference_drafter(raw, weights), target)

    out = convert_drafter(str(src), tmp_path / "out", dtype="float32")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "dflash" and written["block_size"] == 4
    assert written["dflash_config"] == {"target_layer_ids": TAPS, "mask_token_id": MASK}
    assert written["rope_theta"] == 10000.0
    assert written.get("rope_scaling", {}).get("rope_type") == ("yarn" if "yarn" in generation else None)

    for path in (out, src):  # converted directory, and the raw z-lab one converted in memory
        drafter = load_drafter(str(path))
        assert drafter.block_size == 4 and drafter.config.target_layer_ids == TAPS
        assert mx.array_equal(draft_logits(drafter, target), expected)


def test_yarn_changes_the_drafter(target):
    weights = zlab_weights()
    plain = draft_logits(reference_drafter(GENERATIONS["old"], weights), target)
    yarn = draft_logits(reference_drafter(GENERATIONS["yarn"], weights), target)
    assert not mx.allclose(plain, yarn)  # otherwise the YaRN cases above would prove nothing


def test_bf16_sharded_prefixed_checkpoint(tmp_path, target):
    # Real z-lab files are bf16; some exports add a `model.` prefix, an inv_freq buffer, or shard the weights.
    raw, weights = GENERATIONS["new"], zlab_weights()
    src = tmp_path / "zlab"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(raw))
    tensors = {"model." + k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((HEAD_DIM // 2,))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(src / shard), {k: tensors[k] for k in keys})
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    expected = draft_logits(reference_drafter(raw, weights, mx.bfloat16), target)
    assert mx.array_equal(draft_logits(load_drafter(str(src)), target), expected)
    out = convert_drafter(str(src), tmp_path / "out")
    drafter = load_drafter(str(out))
    assert drafter.fc.weight.dtype == mx.bfloat16
    assert mx.array_equal(draft_logits(drafter, target), expected)


def test_convert_twice_is_byte_identical(zlab, tmp_path):
    src, weights = zlab
    for kwargs in ({"dtype": "float32"}, {"q_bits": 8}):
        a = convert_drafter(str(src), tmp_path / "a", force=True, **kwargs)
        b = convert_drafter(str(src), tmp_path / "b", force=True, **kwargs)
        for name in ("config.json", "model.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # The hand-written file reads back with the reference safetensors library, values intact.
    a = convert_drafter(str(src), tmp_path / "a", dtype="float32", force=True)
    with safe_open(str(a / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(weights)
        assert f.metadata() == {"format": "mlx"}
        for key, value in weights.items():
            np.testing.assert_array_equal(f.get_tensor(key), value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(dtype, zlab, tmp_path, target):
    src, weights = zlab
    out = convert_drafter(str(src), tmp_path / "out", dtype=dtype)
    drafter = load_drafter(str(out))
    assert all(v.dtype == getattr(mx, dtype) for _, v in nn.utils.tree_flatten(drafter.parameters()))
    expected = draft_logits(reference_drafter(GENERATIONS["old"], weights, getattr(mx, dtype)), target)
    assert mx.array_equal(draft_logits(drafter, target), expected)


@pytest.mark.parametrize("bits,tolerance", [(4, 0.5), (8, 0.08)])
def test_quantized_conversion(bits, tolerance, zlab, tmp_path, target):
    src, weights = zlab
    out = convert_drafter(str(src), tmp_path / "out", q_bits=bits, q_group_size=64)
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": bits}
    drafter = load_drafter(str(out))
    attn, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == bits
    assert isinstance(drafter.fc, nn.QuantizedLinear)
    assert type(mlp.down_proj) is nn.Linear  # input width 96 is not a multiple of the group size
    got = draft_logits(drafter, target)
    # Exactly what mlx's own quantization of the bf16 drafter gives ...
    direct = reference_drafter(GENERATIONS["old"], weights, mx.bfloat16)
    nn.quantize(direct, group_size=64, bits=bits,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 64 == 0)
    assert mx.array_equal(got, draft_logits(direct, target))
    # ... and close to, but not equal to, the float drafter (tiny random layers quantize coarsely).
    ref = draft_logits(reference_drafter(GENERATIONS["old"], weights), target)
    err = (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item()
    assert 0 < err < tolerance, err
    raises(lambda: convert_drafter(str(out), tmp_path / "again", q_bits=4), "already quantized")


def test_hub_repo_id_uses_snapshot_download(zlab, tmp_path, monkeypatch):
    import huggingface_hub

    src, _ = zlab
    calls = []

    def fake_download(repo_id, revision=None, allow_patterns=None, **_):
        calls.append((repo_id, revision, allow_patterns))
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    out = convert_drafter("z-lab/Tiny-DFlash", tmp_path / "out", revision="abc123")
    assert calls == [("z-lab/Tiny-DFlash", "abc123", ["*.json", "*.safetensors"])]
    assert load_drafter(str(out)).block_size == 4


def test_hub_offline_is_one_clear_line(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*_, **__):
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache.\nTry again online.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    raises(lambda: load_drafter("z-lab/Tiny-DFlash"), "z-lab/Tiny-DFlash", "could not download", "disk cache")
    raises(lambda: convert_drafter("z-lab/Tiny-DFlash", tmp_path / "out"), "could not download")


# -- failures -----------------------------------------------------------------------------------------------------
def _broken(tmp_path, edit):
    weights = zlab_weights()
    edit(weights)
    return str(write_checkpoint(tmp_path / "broken", GENERATIONS["old"], weights))


def test_shape_mismatch(tmp_path):
    def wide_fc(w):
        w["fc.weight"] = np.zeros((H, 3 * H), np.float32)

    src = _broken(tmp_path, wide_fc)
    for fn in (lambda: load_drafter(src), lambda: convert_drafter(src, tmp_path / "out")):
        raises(fn, "tensor fc.weight has shape [64, 192], expected [64, 128] for this config")


def test_missing_and_unknown_tensors(tmp_path):
    src = _broken(tmp_path, lambda w: w.pop("layers.1.mlp.up_proj.weight"))
    raises(lambda: load_drafter(src), "lacks tensor 'layers.1.mlp.up_proj.weight'")
    src = _broken(tmp_path, lambda w: w.update({"embed_tokens.weight": np.zeros((VOCAB, H), np.float32)}))
    raises(lambda: convert_drafter(src, tmp_path / "out"), "unexpected tensor 'embed_tokens.weight'")


def test_missing_and_corrupt_files(zlab, tmp_path):
    src, _ = zlab
    weights_file = src / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    raises(lambda: load_drafter(str(src)), "model.safetensors", "is truncated", "download or convert")
    weights_file.unlink()
    raises(lambda: load_drafter(str(src)), "has no model.safetensors")
    (src / "config.json").unlink()
    raises(lambda: convert_drafter(str(src), tmp_path / "out"), "has no config.json")
    raises(lambda: load_drafter(str(tmp_path / "nowhere")), "does not exist")


def test_bad_options_and_formats(zlab, tmp_path):
    src, weights = zlab
    raises(lambda: convert_drafter(str(src), tmp_path / "o", dtype="int8"), "unsupported dtype 'int8'")
    raises(lambda: convert_drafter(str(src), tmp_path / "o", q_bits=3), "unsupported quantization bits 3")
    raises(lambda: convert_drafter(str(src), tmp_path / "o", q_bits=4, q_group_size=48), "group size 48")
    raises(lambda: convert_drafter(str(src), src), "is the source directory")
    spec = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "sample_from_anchor": True,
            "transformer_layer_config": BASE, "aux_hidden_state_layer_ids": [2, 3]}
    other = write_checkpoint(tmp_path / "spec", spec, weights)
    raises(lambda: load_drafter(str(other)), "sample_from_anchor")
    target_like = write_checkpoint(tmp_path / "target", {**BASE, "architectures": ["Qwen3ForCausalLM"]}, weights)
    raises(lambda: load_drafter(str(target_like)), "not a DFlash drafter")


# -- vLLM speculators packaging ------------------------------------------------------------------------------------
def _speculators(raw_zlab: dict, draft_vocab=None, non_causal=False) -> dict:
    """The speculators config of the same drafter: the layer config nested, taps + 1, the block and mask on top."""
    dflash = raw_zlab["dflash_config"]
    inner = {k: v for k, v in raw_zlab.items() if k not in ("dflash_config", "block_size", "architectures")}
    out = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
           "transformer_layer_config": inner, "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
           "block_size": raw_zlab["block_size"], "mask_token_id": dflash["mask_token_id"],
           "draft_vocab_size": draft_vocab or VOCAB, "sample_from_anchor": False,
           "speculators_config": {"algorithm": "dflash", "proposal_methods": [{"speculative_tokens": 3}]}}
    if non_causal:
        out["sliding_window_non_causal"] = True
    return out


def test_speculators_checkpoint_drafts_as_its_zlab_twin(tmp_path, target):
    """A speculators DFlash checkpoint (full vocabulary: copies of the target's embedding, head and final norm, the
    t2d mask) loads and converts to the drafter its z-lab twin gives, logits bit for bit."""
    raw, weights = GENERATIONS["old"], zlab_weights()
    expected = draft_logits(reference_drafter(raw, weights), target)
    rng = np.random.default_rng(1)
    extra = {"embed_tokens.weight": rng.standard_normal((VOCAB, H)).astype(np.float32),
             "lm_head.weight": rng.standard_normal((VOCAB, H)).astype(np.float32),
             "verifier_norm.weight": np.ones(H, np.float32), "t2d": np.ones(VOCAB, np.bool_)}
    src = write_checkpoint(tmp_path / "spec", _speculators(raw), {**weights, **extra})
    drafter = load_drafter(str(src))
    assert drafter.block_size == 4 and drafter.config.target_layer_ids == TAPS and drafter.config.mask_token_id == MASK
    assert drafter.config.draft_vocab_size is None
    assert mx.array_equal(draft_logits(drafter, target), expected)
    out = convert_drafter(str(src), tmp_path / "out", dtype="float32")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "dflash" and written["dflash_config"]["target_layer_ids"] == TAPS
    assert mx.array_equal(draft_logits(load_drafter(str(out)), target), expected)


def test_speculators_reduced_vocabulary_keeps_its_head_and_d2t(tmp_path, target):
    """With draft_vocab_size < vocab_size the checkpoint's own head and d2t (int64 from PyTorch) are the drafter's:
    the same logits as our form of that drafter."""
    raw, weights = GENERATIONS["old"], zlab_weights()
    draft_vocab = 40
    rng = np.random.default_rng(2)
    head = (rng.standard_normal((draft_vocab, H)) / np.sqrt(H)).astype(np.float32)
    d2t = np.sort(rng.choice(VOCAB, draft_vocab, replace=False)) - np.arange(draft_vocab)
    ours = {**raw, "draft_vocab_size": draft_vocab}
    expected = draft_logits(reference_drafter(ours, {**weights, "lm_head.weight": head,
                                                     "d2t": d2t.astype(np.int32)}), target)
    src = write_checkpoint(tmp_path / "spec", _speculators(raw, draft_vocab),
                           {**weights, "lm_head.weight": head, "d2t": d2t.astype(np.int64),
                            "t2d": np.zeros(VOCAB, np.bool_), "embed_tokens.weight": np.zeros((VOCAB, H), np.float32)})
    drafter = load_drafter(str(src))
    assert drafter.config.draft_vocab_size == draft_vocab and drafter.d2t.dtype == mx.int32
    assert mx.array_equal(draft_logits(drafter, target), expected)


def test_speculators_sliding_non_causal_and_bad_configs(tmp_path):
    raw, weights = GENERATIONS["old"], zlab_weights()
    src = write_checkpoint(tmp_path / "spec", _speculators(raw, non_causal=True), weights)
    assert load_drafter(str(src)).config.is_causal is False
    broken = {k: v for k, v in _speculators(raw).items() if k != "transformer_layer_config"}
    broken["speculators_model_type"] = "dflash"
    src = write_checkpoint(tmp_path / "broken", broken, weights)
    raises(lambda: load_drafter(str(src)), "lacks its transformer_layer_config")
    src = write_checkpoint(tmp_path / "extra", _speculators(raw), {**weights, "markov.weight": np.zeros(3, np.float32)})
    raises(lambda: load_drafter(str(src)), "unexpected tensor 'markov.weight'")
