"""A tiny random target + drafter pair, built offline in seconds, for demos, smoke tests and CI.

The target is an ordinary mlx-lm model folder (config.json, fp32 model.safetensors, and a real byte-level BPE
tokenizer with a ChatML chat template), so `mlx_lm.load` reads it like any downloaded model. The drafter folder
is in our converted format: the normalized `DFlashConfig.to_dict()` plus the drafter's flattened parameters.
Weights are random, so the text is gibberish and few drafts are accepted; the pair exercises every code path.

    python -m dflash_mlx.demo OUT_DIR      # prints OUT_DIR/target and OUT_DIR/drafter
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from .drafters.config import DFlashConfig
from .drafters.dflash import DFlashDrafter

ARCHS = ("qwen3", "qwen2", "llama")
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 4, 2, 16, 128
TOKENIZER_VOCAB = 320
# `python -m dflash_mlx.demo` builds a context with room for a coding agent's first request (Claude Code's is
# ~80 KB of text, ~10-60k tokens of this small vocabulary); tests build small ones by default.
AGENT_CONTEXT = 131072
SMALL_CONTEXT = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Enough English for a few dozen BPE merges; the tokenizer still covers every byte.
CORPUS = [
    "Hello! How are you today? I am fine, thank you. The weather is nice and the sun is shining.",
    "Speculative decoding drafts several tokens with a small model and verifies them with the large one.",
    "A block diffusion drafter fills a whole block of masked tokens in a single forward pass.",
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Once upon a time there was a tiny model that wanted to generate text faster than ever before.",
]


def _build_tokenizer(out: Path) -> Dict[str, int]:
    """Train a byte-level BPE on the built-in corpus, save it as a transformers tokenizer; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # transformers 5 records its own backend class name; the generic one loads under 4.x as well.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, tok_config)
    return {t: tok.token_to_id(t) for t in SPECIALS} | {"vocab_size": tok.get_vocab_size()}


def _target_config(arch: str, vocab_size: int, eos_id: int, context: int) -> Dict[str, Any]:
    return {
        "model_type": arch,
        "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "llama": "LlamaForCausalLM"}[arch]],
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _save_weights(path: Path, params: Any) -> None:
    flat = dict(sorted(tree_flatten(params)))
    mx.eval(flat)
    mx.save_safetensors(str(path), flat)


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n")


def make_tiny_pair(out_dir, *, arch: str = "qwen3", seed: int = 0, block_size: int = 4,
                   context: int = SMALL_CONTEXT) -> Tuple[Path, Path]:
    """Write `out_dir/target` (mlx-lm model + tokenizer) and `out_dir/drafter` (DFlash drafter); return both.
    `context`: the target's max_position_embeddings (the demo command's pair: `AGENT_CONTEXT`)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    target_dir, drafter_dir = out / "target", out / "drafter"
    target_dir.mkdir(parents=True, exist_ok=True)
    drafter_dir.mkdir(parents=True, exist_ok=True)

    ids = _build_tokenizer(target_dir)
    vocab = ids["vocab_size"]
    config = _target_config(arch, vocab, ids["<|im_end|>"], context)
    _write_json(target_dir / "config.json", config)

    mx.random.seed(seed)
    arch_module = importlib.import_module(f"mlx_lm.models.{arch}")
    target = arch_module.Model(arch_module.ModelArgs.from_dict(config))
    _save_weights(target_dir / "model.safetensors", target.parameters())

    draft_config = DFlashConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=FFN,
        vocab_size=vocab,
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        num_target_layers=LAYERS,
        block_size=block_size,
        target_layer_ids=[1, LAYERS - 2],
        mask_token_id=ids["<|mask|>"],
    )
    _write_json(drafter_dir / "config.json", draft_config.to_dict())
    _save_weights(drafter_dir / "model.safetensors", DFlashDrafter(draft_config).parameters())
    return target_dir, drafter_dir


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m dflash_mlx.demo OUT_DIR", file=sys.stderr)
        return 2
    target_dir, drafter_dir = make_tiny_pair(args[0], context=AGENT_CONTEXT)
    print(target_dir)
    print(drafter_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
