"""GGUF conversion on synthetic files written with gguf.GGUFWriter: no downloads, a few seconds.

Checks dequantization against numpy (and, for K-quants, against hand-built blocks decoded by an independent
reference), llama.cpp's Q/K permutation round trip, and whole tiny llama / qwen2 / gemma3 models: written the way
llama.cpp's converter writes them, converted back, loaded with mlx_lm.load, same logits as the original.
"""

import json

import dflash_mlx  # noqa: F401  (first: OpenBLAS before mlx)
import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load as mlx_lm_load
from tokenizers.pre_tokenizers import ByteLevel

from dflash_mlx.cli import main
from dflash_mlx.convert.gguf import GGUFFile, build_config, convert_gguf, dequantize, unpermute_qk
from dflash_mlx.errors import DFlashError



def _write(path, arch, tensors, *, meta=None, tokenizer=True):
    """A GGUF file: {name: (array, ggml type)}; float arrays are quantized with gguf.quants where asked."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    if tokenizer:
        _add_tokenizer(w)
    for name, (a, qtype) in tensors.items():
        if a.dtype == np.uint8:  # raw blocks
            w.add_tensor(name, a, raw_dtype=qtype)
        elif qtype in (T.F32, T.F16):
            w.add_tensor(name, a.astype(np.float32 if qtype == T.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + 1 + len(SPECIALS)  # byte alphabet, one merge, specials
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _add_tokenizer(w):
    alphabet = sorted(ByteLevel.alphabet())
    tokens = alphabet + ["he"] + SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(TEMPLATE)


# -- dequantization -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype,tol", [(T.F32, 0.0), (T.F16, 1e-3), (T.BF16, 1e-2), (T.Q8_0, 0.02),
                                       (T.Q5_0, 0.1), (T.Q5_1, 0.1), (T.Q4_0, 0.2), (T.Q4_1, 0.2)])
def test_dequantize_round_trip(tmp_path, qtype, tol):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    f = GGUFFile(_write(tmp_path / "t.gguf", "llama", {"w": (x, qtype)}, tokenizer=False))
    got = dequantize(f.tensors["w"])
    assert got.shape == x.shape and got.dtype == np.float32
    ref = x if qtype == T.F32 else gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    assert np.abs(got - x).max() <= tol * np.abs(x).max()


def _f16(v):
    return np.array([v], dtype=np.float16).view(np.uint8)


# Independent decoders: scalar transcriptions of ggml's dequantize_row_q4_K / dequantize_row_q6_K (ggml-quants.c),
# element by element in float32 as the C code computes, sharing nothing with the gguf package's vectorized numpy.
def _half(raw, at):
    return np.float32(np.frombuffer(bytes(raw[at:at + 2]), dtype=np.float16)[0])


def _scale_min_k4(j, q):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j, packed into 12 bytes."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def decode_q4_k_block(raw):
    """block_q4_K: d (f16), dmin (f16), scales[12], qs[128] -> 256 floats."""
    d, dmin = _half(raw, 0), _half(raw, 2)
    scales, qs = [int(b) for b in raw[4:16]], [int(b) for b in raw[16:144]]
    y, q, sub = [], 0, 0
    for _ in range(0, 256, 64):
        sc, m = _scale_min_k4(sub, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(sub + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        y += [d1 * np.float32(qs[q + l] & 0xF) - m1 for l in range(32)]
        y += [d2 * np.float32(qs[q + l] >> 4) - m2 for l in range(32)]
        q, sub = q + 32, sub + 2
    return np.array(y, dtype=np.float32)


def decode_q6_k_block(raw):
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16) -> 256 floats."""
    ql, qh = [int(b) for b in raw[0:128]], [int(b) for b in raw[128:192]]
    sc = [int(b) for b in np.frombuffer(bytes(raw[192:208]), dtype=np.int8)]
    d = _half(raw, 208)
    y = np.zeros(256, np.float32)
    for n in range(2):  # two halves of 128 weights
        base, l0, h0, s0 = 128 * n, 64 * n, 32 * n, 8 * n
        for l in range(32):
            i = l // 16
            q1 = ((ql[l0 + l] & 0xF) | (((qh[h0 + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l0 + l + 32] & 0xF) | (((qh[h0 + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l0 + l] >> 4) | (((qh[h0 + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l0 + l + 32] >> 4) | (((qh[h0 + l] >> 6) & 3) << 4)) - 32
            y[base + l] = d * np.float32(sc[s0 + i]) * np.float32(q1)
            y[base + l + 32] = d * np.float32(sc[s0 + i + 2]) * np.float32(q2)
            y[base + l + 64] = d * np.float32(sc[s0 + i + 4]) * np.float32(q3)
            y[base + l + 96] = d * np.float32(sc[s0 + i + 6]) * np.float32(q4)
    return y


def _random_blocks(rng, rows, blocks, size, halves):
    """Random block bytes with finite, non-trivial fp16 super-block scales written at `halves` offsets."""
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in halves:
        values = rng.uniform(0.002, 0.05, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks))
        raw[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return raw


def test_independent_decoders_on_hand_built_blocks():
    """The transcriptions themselves, on blocks whose values are worked out by hand."""
    q4 = np.zeros(144, np.uint8)
    q4[0:2], q4[2:4] = _f16(0.5), _f16(0.25)
    # scales[0..3] / [4..7]: 6-bit scale / min of sub-blocks 0-3; their top two bits and scales[8..11] make 4-7.
    q4[4:16] = [0xC0 | 1, 2, 3, 4, 0x80 | 5, 6, 7, 8, 0x49, 10, 11, 12]
    q4[16:48] = 0x73  # sub-blocks 0 and 1: low nibble 3, high nibble 7
    q4[80:112] = 0x21  # sub-blocks 4 and 5: low nibble 1
    y = decode_q4_k_block(q4)
    assert y[0] == 0.5 * 1 * 3 - 0.25 * 5 and y[32] == 0.5 * 2 * 7 - 0.25 * 6
    assert _scale_min_k4(4, [int(b) for b in q4[4:16]]) == (9 | 3 << 4, 4 | 2 << 4)  # (57, 36)
    assert y[128] == 0.5 * 57 * 1 - 0.25 * 36
    q6 = np.zeros(210, np.uint8)
    q6[0], q6[128], q6[192:208], q6[208:210] = 0x5A, 0b10, np.arange(-8, 8, dtype=np.int8).view(np.uint8), _f16(2.0)
    y = decode_q6_k_block(q6)
    assert y[0] == 2.0 * -8 * ((0xA | (2 << 4)) - 32) and y[64] == 2.0 * -4 * (5 - 32)


def test_q4_k_against_independent_reference(tmp_path):
    rng = np.random.default_rng(1)
    raw = _random_blocks(rng, rows=3, blocks=2, size=144, halves=(0, 2))
    expected = np.stack([np.concatenate([decode_q4_k_block(b) for b in row]) for row in raw])
    assert len(np.unique(expected)) > 500  # scales and mins vary: a misplaced one shows
    f = GGUFFile(_write(tmp_path / "k.gguf", "llama", {"w": (raw.reshape(3, -1), T.Q4_K)}, tokenizer=False))
    np.testing.assert_array_equal(dequantize(f.tensors["w"]), expected)


def test_q6_k_against_independent_reference(tmp_path):
    rng = np.random.default_rng(2)
    raw = _random_blocks(rng, rows=2, blocks=2, size=210, halves=(208,))
    expected = np.stack([np.concatenate([decode_q6_k_block(b) for b in row]) for row in raw])
    assert len(np.unique(expected)) > 500
    f = GGUFFile(_write(tmp_path / "k6.gguf", "llama", {"w": (raw.reshape(2, -1), T.Q6_K)}, tokenizer=False))
    np.testing.assert_array_equal(dequantize(f.tensors["w"]), expected)


@pytest.mark.parametrize("qtype,size,scale_at", [(T.Q2_K, 84, (80, 82)), (T.Q3_K, 110, (108,)),
                                                 (T.Q5_K, 176, (0, 2))])
def test_other_k_quants_match_gguf(tmp_path, qtype, size, scale_at):
    # Random blocks with finite fp16 scales: file reading, row chunking and shapes around gguf's own decoder.
    raw = np.random.default_rng(4).integers(0, 256, (5, 2 * size), dtype=np.uint8)
    for block in range(2):
        for at in scale_at:
            raw[:, block * size + at:block * size + at + 2] = _f16(0.01)
    f = GGUFFile(_write(tmp_path / "k.gguf", "llama", {"w": (raw, qtype)}, tokenizer=False))
    got = dequantize(f.tensors["w"], rows_per_chunk=2)
    assert got.shape == (5, 512) and np.isfinite(got).all()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))


def _llama_cpp_permute(w, n_head):
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(4, 16), (3, 64), (1, 8)])
def test_unpermute_inverts_llama_cpp(n_head, head_dim):
    w = np.random.default_rng(3).standard_normal((n_head * head_dim, 24)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    b = w[:, 0]
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(b, n_head), n_head), b)


# -- whole tiny models ----------------------------------------------------------------------------------------
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                  rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=512),
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                   vocab_size=VOCAB, rope_theta=1000000.0, query_pre_attn_scalar=32, sliding_window=8,
                   max_position_embeddings=512),
}
TO_GGUF = {  # mlx-lm names -> llama.cpp names, written out independently of the converter's table
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
GEMMA_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(name, arch):
    parts = name.split(".")
    kind = parts[-1]
    base = ".".join(parts[:-1])
    if base in TO_GGUF:
        return f"{TO_GGUF[base]}.{kind}"
    layer, rest = parts[2], ".".join(parts[3:-1])
    table = {**TO_GGUF, **GEMMA_TO_GGUF} if arch == "gemma3" else TO_GGUF
    return f"blk.{layer}.{table[rest]}.{kind}"


def _export(model, config, arch, path, qtype=T.F32):
    """Write an mlx-lm model as llama.cpp would: renamed, Q/K permuted (llama), norms as 1 + w (gemma3)."""
    tensors = {}
    for name, p in tree_flatten(model.parameters()):
        a = np.array(p, dtype=np.float32)
        g = _gguf_name(name, arch)
        if arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if ".attn_q." in g else config["num_key_value_heads"]
            a = _llama_cpp_permute(a, heads)
        if arch == "gemma3" and "norm" in g:
            a = a + 1.0
        tensors[g] = (a, qtype if a.ndim == 2 and a.shape[-1] % 32 == 0 else T.F32)
    c = config
    meta = {f"{arch}.block_count": c["num_hidden_layers"], f"{arch}.embedding_length": c["hidden_size"],
            f"{arch}.feed_forward_length": c["intermediate_size"],
            f"{arch}.attention.head_count": c["num_attention_heads"],
            f"{arch}.attention.head_count_kv": c["num_key_value_heads"],
            f"{arch}.attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
            f"{arch}.rope.freq_base": float(c["rope_theta"]), f"{arch}.context_length": 512}
    if "head_dim" in c:
        meta[f"{arch}.attention.key_length"] = c["head_dim"]
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = c["sliding_window"]
    return _write(path, arch, tensors, meta=meta)


def randomize(model, seed):
    """Redraw every parameter (norms around 1) so a misplaced or mis-scaled tensor shows in the logits."""
    from mlx.utils import tree_unflatten

    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        z = rng.standard_normal(p.shape).astype(np.float32)
        new.append((name, mx.array(1.0 + 0.2 * z if name.endswith("norm.weight") else z / np.sqrt(p.shape[-1]))))
    model.update(tree_unflatten(new))
    return model


def _tiny(arch, seed=0):
    config = CONFIGS[arch]
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if arch == "gemma3":
        model.sanitize({})  # gemma3 files tie the head to the embedding: drop the separate lm_head
    return randomize(model, seed)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_model_round_trip(tmp_path, arch):
    model = _tiny(arch)
    path = _export(model, CONFIGS[arch], arch, tmp_path / f"{arch}.gguf")
    out = convert_gguf(path, tmp_path / "out", progress=False)
    loaded, tokenizer = mlx_lm_load(str(out))
    ids = mx.array([[5, 17, 250, 3, 99, 120, 7]])
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(model(ids)), rtol=1e-4, atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == CONFIGS[arch]["model_type"]
    assert config["tie_word_embeddings"] == CONFIGS[arch].get("tie_word_embeddings", True)
    # The tokenizer came from the GGUF metadata: merges, specials, eos and chat template.
    assert tokenizer.encode("hehe", add_special_tokens=False) == [256, 256]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [VOCAB - 1]
    assert tokenizer.eos_token_ids == {VOCAB - 1}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hugging_face_folder_without_mlx_holds_the_same_model(tmp_path, arch):
    """`convert_gguf_to_hf` (numpy only, for PyTorch machines) writes the fp32 weights `convert_gguf` gives mlx-lm,
    and transformers computes the same logits from that folder."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_mlx.convert.gguf import convert_gguf_to_hf
    from safetensors.numpy import load_file

    model = _tiny(arch)
    path = _export(model, CONFIGS[arch], arch, tmp_path / f"{arch}.gguf", qtype=T.Q8_0)
    mlx_dir = convert_gguf(path, tmp_path / "mlx", progress=False)
    hf_dir = convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    ours = dict(tree_flatten(mlx_lm_load(str(mlx_dir))[0].parameters()))
    theirs = load_file(str(hf_dir / "model.safetensors"))
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        np.testing.assert_array_equal(value, np.array(ours[name]), err_msg=name)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ids = [5, 17, 250, 3, 99, 120, 7]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, np.array(mlx_lm_load(str(mlx_dir))[0](mx.array([ids]))[0]), atol=1e-4, rtol=1e-4)
    assert AutoTokenizer.from_pretrained(str(hf_dir)).encode("hehe", add_special_tokens=False) == [256, 256]


def test_quantized_blocks_and_requantized_output(tmp_path):
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    model = _tiny("llama")
    path = _export(model, CONFIGS["llama"], "llama", tmp_path / "q.gguf", qtype=T.Q8_0)
    assert GGUFFile(path).tensors["blk.0.attn_q.weight"].tensor_type == T.Q8_0
    # The reference: the original model with every Q8_0 weight replaced by its numpy round trip.
    rounded = []
    for name, p in tree_flatten(model.parameters()):
        a = np.array(p)
        if a.ndim == 2:
            a = gguf.quants.dequantize(gguf.quants.quantize(a, T.Q8_0), T.Q8_0)
        rounded.append((name, mx.array(a)))
    model.update(tree_unflatten(rounded))
    ids = mx.array([[5, 17, 250, 3]])
    fp32 = convert_gguf(path, tmp_path / "fp32", progress=False)
    loaded = mlx_lm_load(str(fp32))[0]
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(model(ids)), rtol=1e-4, atol=1e-4)
    # Re-quantized output = mlx-lm's quantizer applied to the fp32 conversion.
    q8 = convert_gguf(path, tmp_path / "q8", q_bits=8, q_group_size=32, progress=False)
    config = json.loads((q8 / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    nn.quantize(loaded, group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(mlx_lm_load(str(q8))[0](ids)), np.array(loaded(ids)))
    bf16 = convert_gguf(path, tmp_path / "bf16", dtype="bf16", progress=False)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_config_from_metadata(tmp_path):
    path = _export(_tiny("gemma3"), CONFIGS["gemma3"], "gemma3", tmp_path / "g.gguf")
    c = build_config(GGUFFile(path))
    assert c["model_type"] == "gemma3_text" and c["head_dim"] == 32 and c["query_pre_attn_scalar"] == 32
    assert c["sliding_window"] == 8 and c["sliding_window_pattern"] == 6 and c["tie_word_embeddings"]


# -- clear failures -----------------------------------------------------------------------------------------
def test_unknown_architecture(tmp_path):
    path = _write(tmp_path / "x.gguf", "mamba", {"token_embd.weight": (np.zeros((VOCAB, 32), np.float32), T.F32)})
    with pytest.raises(DFlashError, match="architecture 'mamba'.*not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_missing_metadata(tmp_path):
    path = _write(tmp_path / "x.gguf", "llama", {"token_embd.weight": (np.zeros((VOCAB, 32), np.float32), T.F32)})
    with pytest.raises(DFlashError, match="lacks the metadata llama.embedding_length"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_unknown_ggml_type(tmp_path):
    raw = np.zeros((4, 18), np.uint8)  # one IQ4_NL block per row
    path = _write(tmp_path / "x.gguf", "llama", {"token_embd.weight": (raw, T.IQ4_NL)})
    with pytest.raises(DFlashError, match="ggml type IQ4_NL"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", "--gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    assert main(["convert", "--gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err
    assert main(["convert", "--gguf", str(tmp_path / "bad.gguf")]) == 2
    assert "output directory" in capsys.readouterr().err


def test_cli_converts(tmp_path, capsys):
    path = _export(_tiny("qwen2"), CONFIGS["qwen2"], "qwen2", tmp_path / "m.gguf")
    assert main(["convert", "--gguf", str(path), str(tmp_path / "out"), "--dtype", "fp16"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    assert main(["convert", "--gguf", str(path), str(tmp_path / "out")]) == 2  # exists: refuse, keep it
    err = capsys.readouterr().err
    assert "already holds a model" in err and "--force" in err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    assert main(["convert", "--gguf", str(path), str(tmp_path / "out"), "--force"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no temporary folder left behind


def test_control_and_user_defined_tokens_become_added_tokens():
    """A rebuilt GGUF tokenizer matches every control / user-defined token whole, whatever the transformers version
    added itself: control tokens as special, user-defined ones as plain added text; nothing is added twice."""
    from tokenizers import Tokenizer, models

    from dflash_mlx.convert.gguf import GGUF_CONTROL, GGUF_USER_DEFINED, add_typed_tokens

    tokens = ["a", "b", "<", "|", "x", ">", "t", "/", "<|x|>", "<t>", "<eos>"]
    types = [1] * 8 + [GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_CONTROL]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.add_special_tokens(["<eos>"])  # what a converter may have added already
    assert backend.encode("a<|x|>b<t>").ids != [0, 8, 1, 9]  # split into pieces before
    add_typed_tokens(backend, tokens, types)
    assert backend.encode("a<|x|>b<t>").ids == [0, 8, 1, 9]
    added = {t.content: t.special for t in backend.get_added_tokens_decoder().values()}
    assert added == {"<|x|>": True, "<t>": False, "<eos>": True}
    add_typed_tokens(backend, tokens, types)  # idempotent
    add_typed_tokens(backend, tokens, None)  # no types in the file: nothing to do
    assert len(backend.get_added_tokens_decoder()) == 3
