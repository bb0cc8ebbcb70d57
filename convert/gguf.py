"""Convert a GGUF file (llama.cpp's format) into an mlx-lm model directory that `mlx_lm.load` reads.

Every tensor is dequantized with the `gguf` package (numpy only), never `mx.load`: MLX's own GGUF reader returns
wrong values for K-quants without an error. Then llama.cpp's layout changes are undone: llama files store Q/K rows
interleaved for their RoPE, gemma files store RMSNorm weights as (1 + w). The tokenizer and chat template come
from the GGUF metadata through transformers' torch-free tokenizer builders. The result is written in fp32, bf16 or
fp16, or re-quantized with mlx-lm's own quantizer, so `mlx_lm.load` and dflash-mlx load it like any mlx-lm model.

    dflash-mlx convert --gguf model.gguf OUT [--dtype fp32|bf16|fp16] [--q-bits 4|8 --q-group-size 64]
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np

from dflash_mlx.dtypes import dtype_name
from dflash_mlx.errors import DFlashError
from dflash_mlx.io_safety import check_output_dir, output_dir


# ggml types we convert, all dequantized by `gguf.quants` (tests/test_gguf.py: Q4_K and Q6_K against an
# independent decoder, the others against numpy round trips); anything else fails with one clear line.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor names -> Hugging Face / mlx-lm names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an mlx-lm model type."""

    model_type: str
    layer_names: Dict[str, str]
    rope_theta: float = 10000.0
    permute_qk: bool = False  # llama.cpp's llama converter interleaves Q/K rows for its RoPE
    norm_offset: float = 0.0  # gemma files store RMSNorm weights as (1 + w)
    defaults: Dict[str, Any] = field(default_factory=dict)


ARCHS: Dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", _LAYER_NAMES, permute_qk=True),
    "qwen2": ArchSpec("qwen2", _LAYER_NAMES, rope_theta=1_000_000.0),
    "qwen3": ArchSpec("qwen3", {**_LAYER_NAMES, **_QK_NORMS}, rope_theta=1_000_000.0),
    "gemma3": ArchSpec(
        "gemma3_text",
        {**_LAYER_NAMES, **_QK_NORMS, "ffn_norm": "pre_feedforward_layernorm",
         "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        rope_theta=1_000_000.0,
        norm_offset=1.0,
        # llama.cpp hard-codes these for gemma3; newer files may state them (read below).
        defaults={"rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "sliding_window": 512},
    ),
}

# llama.cpp pre-tokenizer names whose split rule transformers' builders do not set.
_DIGIT_SPLIT_PRETOKENIZERS = ("smollm",)


# -- reading ------------------------------------------------------------------------------------------------
class GGUFFile:
    """A GGUF file's metadata (as Python values) and tensors (read lazily through a memory map)."""

    def __init__(self, path: Union[str, Path]):
        from gguf import GGUFReader

        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise DFlashError(f"GGUF file '{self.path}' is a folder; give the .gguf file itself")
        if not self.path.is_file():
            raise DFlashError(f"GGUF file '{self.path}' does not exist")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # bad magic, truncation, or a ggml type this gguf version does not know
            raise DFlashError(f"cannot read '{self.path}' as GGUF ({type(e).__name__}: "
                              f"{' '.join(str(e).split())}); is it a complete GGUF file?") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return default if value is None else value

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def arch_spec(gguf: GGUFFile) -> ArchSpec:
    if gguf.arch not in ARCHS:
        raise DFlashError(f"GGUF architecture '{gguf.arch or '?'}' in '{gguf.path.name}' is not supported; "
                          f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[gguf.arch]


def check_types(gguf: GGUFFile) -> None:
    for t in gguf.reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise DFlashError(f"tensor '{t.name}' in '{gguf.path.name}' has ggml type {t.tensor_type.name}, which "
                              f"dflash-mlx cannot convert; supported: {', '.join(SUPPORTED_TYPES)}")


def dequantize(tensor, rows_per_chunk: int = 16384) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major, Hugging Face shape), dequantized by the gguf package."""
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest-moving dimension first
    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        out = gguf_dequantize(data, tensor.tensor_type)
    else:  # bounded temporaries for big embeddings
        out = np.concatenate([gguf_dequantize(data[i:i + rows_per_chunk], tensor.tensor_type)
                              for i in range(0, data.shape[0], rows_per_chunk)])
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (per head: pairs (x0, x1) -> halves) for rope_traditional=False."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


# -- config -------------------------------------------------------------------------------------------------
def build_config(gguf: GGUFFile, spec: Optional[ArchSpec] = None) -> Dict[str, Any]:
    """The mlx-lm config.json for this file (without torch_dtype / quantization)."""
    spec = spec or arch_spec(gguf)
    g = gguf.arch_get
    missing = [k for k in ("embedding_length", "attention.head_count", "block_count", "feed_forward_length")
               if g(k) is None]
    if missing:
        raise DFlashError(f"'{gguf.path.name}' lacks the metadata {gguf.arch}.{missing[0]}; it is not a complete "
                          f"{gguf.arch} model file: download it again")
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    kv_heads = g("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise DFlashError(f"'{gguf.path.name}' has a different KV head count per layer, which is not supported")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise DFlashError(f"'{gguf.path.name}' has no token_embd.weight tensor; is it a language model?")
    config: Dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(embed.shape[1]),
        "max_position_embeddings": int(g("context_length", 4096)),
        "rope_theta": _f32(g("rope.freq_base", spec.rope_theta)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        **spec.defaults,
    }
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = float(g("rope.scaling.factor", 1.0))
        if scaling != "linear":
            raise DFlashError(f"'{gguf.path.name}' uses rope scaling '{scaling}', which the GGUF converter does "
                              "not support yet (only linear)")
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    if spec.model_type == "gemma3_text":
        config["sliding_window"] = int(g("attention.sliding_window", config["sliding_window"]))
        config["sliding_window_pattern"] = int(g("attention.sliding_window_pattern",
                                                 config["sliding_window_pattern"]))
        # llama.cpp: the 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
        config["query_pre_attn_scalar"] = (hidden // heads if config["num_hidden_layers"] == 62
                                           else config["head_dim"])
    eos = [gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    return config


# -- weights ------------------------------------------------------------------------------------------------
def hf_name(gguf_name: str, spec: ArchSpec) -> Optional[str]:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors we drop."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in spec.layer_names:
        return f"model.layers.{m.group(1)}.{spec.layer_names[m.group(2)]}.{kind}"
    if base == "rope_freqs" or base.endswith("rope_freqs"):
        return None  # precomputed RoPE factors; mlx-lm computes its own
    raise DFlashError(f"GGUF tensor '{gguf_name}' has no mlx-lm counterpart for architecture "
                      f"'{spec.model_type}'; this file is not a layout the converter knows")


def convert_tensor(tensor, spec: ArchSpec, config: Dict[str, Any]) -> np.ndarray:
    """Dequantize one tensor and undo llama.cpp's layout changes."""
    w = dequantize(tensor)
    base = tensor.name.rpartition(".")[0]
    if spec.permute_qk and base.endswith((".attn_q", ".attn_k")):
        heads = config["num_attention_heads"] if base.endswith(".attn_q") else config["num_key_value_heads"]
        w = unpermute_qk(w, heads)
    if spec.norm_offset and base.endswith("norm"):
        w = w - np.float32(spec.norm_offset)
    return w


def converted_tensors(gguf: GGUFFile, spec: ArchSpec, config: Dict[str, Any], progress: bool = True):
    """(Hugging Face / mlx-lm name, fp32 numpy array) for every tensor the model keeps, one at a time."""
    from tqdm import tqdm

    for tensor in tqdm(gguf.reader.tensors, desc=f"dequantizing {gguf.path.name}", unit="tensor",
                       disable=not progress):
        name = hf_name(tensor.name, spec)
        if name is not None:
            yield name, convert_tensor(tensor, spec, config)


def read_weights(gguf: GGUFFile, spec: ArchSpec, config: Dict[str, Any], dtype: str, progress: bool = True):
    """All tensors as mlx arrays under mlx-lm names, cast to `dtype`."""
    import mlx.core as mx

    weights = {}
    for name, value in converted_tensors(gguf, spec, config, progress):
        w = mx.array(value).astype(getattr(mx, dtype))
        mx.eval(w)  # materialize now so the numpy temporaries are freed tensor by tensor
        weights[name] = w
    return weights


# -- tokenizer ----------------------------------------------------------------------------------------------
_TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}


def build_tokenizer(gguf: GGUFFile):
    """A `PreTrainedTokenizerFast` rebuilt from the GGUF vocabulary, without torch."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:  # transformers 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4
        from transformers.integrations.ggml import convert_gguf_tokenizer

    tok = {name: gguf.get(f"tokenizer.ggml.{key}") for key, name in _TOKENIZER_KEYS.items()}
    tok = {k: v for k, v in tok.items() if v is not None}
    if not tok.get("tokens"):
        raise DFlashError(f"'{gguf.path.name}' carries no tokenizer (tokenizer.ggml.tokens); cannot convert it")
    try:
        backend, extra = convert_gguf_tokenizer(gguf.arch, tok)
    except Exception as e:
        raise DFlashError(f"cannot rebuild the tokenizer of '{gguf.path.name}' "
                          f"({tok.get('tokenizer_type')}): {' '.join(str(e).split())}") from None
    backend = getattr(backend, "backend_tokenizer", backend)
    add_typed_tokens(backend, tok["tokens"], tok.get("token_type"))
    if tok.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRETOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    tokens = tok["tokens"]
    special = {name: tokens[tok[key]] for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                ("pad_token", "pad_token_id")) if tok.get(key) is not None and tok[key] < len(tokens)}
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", tok.get("tokenizer_type") == "llama")
    # transformers 4 also returns clean_up_tokenization_spaces among the extras: ours (False) wins.
    kwargs = {k: v for k, v in (extra or {}).items() if k not in special}
    kwargs["clean_up_tokenization_spaces"] = False
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **special, **kwargs)
    _set_add_bos(hf, bool(add_bos), special.get("bos_token"))
    template = gguf.get("tokenizer.chat_template")
    if template:
        hf.chat_template = str(template)
    return hf


# GGUF token types (llama.cpp's llama_token_type): control tokens are special, user-defined ones are added text.
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4


def add_typed_tokens(backend, tokens: List[str], types: Optional[List[int]]) -> None:
    """Make every control and user-defined token of the GGUF an added token of `backend` (control ones special),
    so each is matched whole in text. Some transformers versions add only BOS/EOS/PAD when they rebuild a GGUF
    tokenizer; then `<|fim_prefix|>` or `<|file_sep|>` would be split into pieces, and the rebuilt tokenizer would
    differ with the transformers version installed."""
    from tokenizers import AddedToken

    if types is None:
        return
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    wanted = [(tokens[i], int(t) == GGUF_CONTROL) for i, t in enumerate(types)
              if int(t) in (GGUF_CONTROL, GGUF_USER_DEFINED) and i < len(tokens) and tokens[i] not in have]
    special = [AddedToken(text, special=True, normalized=False) for text, is_control in wanted if is_control]
    plain = [AddedToken(text, special=False, normalized=False) for text, is_control in wanted if not is_control]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _set_add_bos(hf, add_bos: bool, bos: Optional[str]) -> None:
    """Make `encode` add BOS exactly when the GGUF says llama.cpp would."""
    from tokenizers import processors

    probe = hf.backend_tokenizer.encode("a").ids
    has_bos = bos is not None and probe[:1] == [hf.convert_tokens_to_ids(bos)]
    if add_bos and bos is not None and not has_bos:
        hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, hf.convert_tokens_to_ids(bos))])
    elif not add_bos and has_bos:
        hf.backend_tokenizer.post_processor = None


def save_tokenizer(hf, out: Path) -> None:
    hf.save_pretrained(str(out))
    # transformers 5 records its backend class name; the generic one loads under 4.x as well.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# -- the whole conversion -----------------------------------------------------------------------------------
def _open(path, out, force: bool, dtype: str):
    """Check `out`, read the file's metadata and tokenizer: (out, gguf, spec, config, tokenizer)."""
    # --force deletes the old `out`: it must not hold the GGUF file being read.
    source = Path(path).expanduser()
    out = check_output_dir(out, force, sources=[source] if source.is_file() else [])
    gguf = GGUFFile(path)
    spec = arch_spec(gguf)
    check_types(gguf)
    config = build_config(gguf, spec)
    config["torch_dtype"] = dtype
    return out, gguf, spec, config, build_tokenizer(gguf)


def convert_gguf(
    path: Union[str, Path],
    out: Union[str, Path],
    *,
    dtype: str = "float32",
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory `out` (written atomically); returns `out`.

    Args:
        path: the .gguf file.
        out: the output directory; must not exist yet (or be empty), unless `force` (replaced on success).
        dtype: float32, bfloat16 or float16 (fp32/bf16/fp16 accepted) for the weights.
        q_bits: re-quantize the linear and embedding layers to 4 or 8 bits with mlx-lm's quantizer.
        q_group_size: quantization group size (32, 64 or 128).
        progress: show progress bars.
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    dtype = dtype_name(dtype)
    if q_bits is not None and q_bits not in (4, 8):
        raise DFlashError(f"--q-bits must be 4 or 8, got {q_bits}")
    if q_bits is not None and q_group_size not in (32, 64, 128):
        raise DFlashError(f"--q-group-size must be 32, 64 or 128, got {q_group_size}")
    out, gguf, spec, config, tokenizer = _open(path, out, force, dtype)
    weights = read_weights(gguf, spec, config, dtype, progress)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"'{gguf.path.name}' does not match mlx-lm's {spec.model_type} layout: "
                          f"{' '.join(str(e).split())}") from None
    del weights
    if q_bits is not None:
        model, config = quantize_model(model, config, q_group_size, q_bits)
    mx.eval(model.parameters())

    with output_dir(out, force, sources=[gguf.path]) as tmp:
        save_model(tmp, model, donate_model=True)
        save_config(config, tmp / "config.json")
        save_tokenizer(tokenizer, tmp)
    return out


def convert_gguf_to_hf(path: Union[str, Path], out: Union[str, Path], *, progress: bool = True,
                       force: bool = False) -> Path:
    """The same conversion without MLX: fp32 weights under Hugging Face names, the config and the tokenizer, in a
    folder that transformers loads (`dflash_mlx.torch_train` reads GGUF targets so, on machines without MLX).

    The weights are exactly those `convert_gguf(..., dtype="float32")` gives mlx-lm (same dequantization, same
    layout fixes); tied heads stay tied (`tie_word_embeddings`), as in the GGUF.
    """
    from safetensors.numpy import save_file

    out, gguf, spec, config, tokenizer = _open(path, out, force, "float32")
    weights = {name: np.ascontiguousarray(value, dtype=np.float32)
               for name, value in converted_tensors(gguf, spec, config, progress)}
    with output_dir(out, force, sources=[gguf.path]) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_tokenizer(tokenizer, tmp)
    return out


def describe(path: Union[str, Path]) -> Dict[str, Any]:
    """Architecture, tensor-type counts and config of a GGUF file, for `--help`-level inspection and tests."""
    gguf = GGUFFile(path)
    counts: Dict[str, int] = {}
    for t in gguf.reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {"architecture": gguf.arch, "types": counts, "config": build_config(gguf)}


__all__: List[str] = ["convert_gguf", "describe", "build_config", "build_tokenizer", "dequantize",
                      "unpermute_qk", "ARCHS", "SUPPORTED_TYPES"]
