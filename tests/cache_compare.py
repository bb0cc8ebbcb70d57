"""Test helpers for target families: tiny random mlx-lm models of every family, and a bit-exact cache comparison.

`assert_caches_equal(a, b)` checks that two per-layer cache lists hold the same state: KV offset and the contents
every future query can see, conv and recurrent state of GatedDeltaNet layers. Used to prove that a cache rolled
back to k accepted tokens equals the cache of a target that processed only those tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.utils import _get_classes

from tiny import randomize  # noqa: F401  (re-exported: family tests import it from here)

VOCAB = 97
HIDDEN = 64
WINDOW = 8  # sliding window of the windowed families: prompts of 20+ tokens run past it

_ATTN = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             vocab_size=VOCAB, max_position_embeddings=1024)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, full_attention_interval=2)
_QWEN3_5_TEXT = dict(**_ATTN, **_GDN, model_type="qwen3_5_text", num_hidden_layers=4, intermediate_size=96,
                     tie_word_embeddings=False,
                     rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# name -> mlx-lm config.json contents
CONFIGS: Dict[str, dict] = {
    # Hybrid GatedDeltaNet + attention, in the nested `language_model` layout of the real checkpoints.
    "qwen3_5": dict(model_type="qwen3_5", text_config=_QWEN3_5_TEXT),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(_QWEN3_5_TEXT, **_MOE, tie_word_embeddings=True)),
    "qwen3_next": dict(**_ATTN, **_GDN, **_MOE, model_type="qwen3_next", num_hidden_layers=4, intermediate_size=96,
                       decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0, partial_rotary_factor=0.5,
                       norm_topk_prob=True),
    # MoE
    "qwen3_moe": dict(_ATTN, model_type="qwen3_moe", num_hidden_layers=3, intermediate_size=96, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                      rope_theta=10000.0, tie_word_embeddings=False, norm_topk_prob=True),
    "deepseek_v3": dict(_ATTN, model_type="deepseek_v3", num_hidden_layers=3, intermediate_size=96,
                        moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1, rope_theta=10000.0),
    # Sliding window + attention sinks + MoE; layers alternate sliding / full.
    "gpt_oss": dict(_ATTN, model_type="gpt_oss", num_hidden_layers=4, intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW, rope_theta=10000.0),
    # Sliding window, embedding scaled by sqrt(hidden); layers alternate sliding / global.
    "gemma3_text": dict(_ATTN, model_type="gemma3_text", num_hidden_layers=4, intermediate_size=96,
                        sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16,
                        rope_theta=10000.0, rope_local_base_freq=1000.0),
    # Gemma 4: per-layer inputs, KV-shared last layers, final logit soft-cap.
    "gemma4_text": dict(_ATTN, model_type="gemma4_text", num_hidden_layers=5, intermediate_size=64,
                        global_head_dim=32, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                        num_kv_shared_layers=2, sliding_window=WINDOW, sliding_window_pattern=3,
                        final_logit_softcapping=30.0, tie_word_embeddings=True),
}
# The nested multimodal layouts (`language_model`), as the real checkpoints ship.
for _text in ("gemma3", "gemma4"):
    CONFIGS[_text] = dict(model_type=_text, vocab_size=VOCAB,
                          text_config={k: v for k, v in CONFIGS[_text + "_text"].items() if k != "vocab_size"})

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE = ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v3")
WINDOWED = ("gpt_oss", "gemma3_text", "gemma3", "gemma4_text", "gemma4")
ALL = tuple(CONFIGS)


def build(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """A fresh tiny fp32 mlx-lm model of family `kind`."""
    config = dict(CONFIGS[kind], **overrides)
    model_class, args_class = _get_classes(config)
    return randomize(model_class(args_class.from_dict(config)), seed)


@functools.lru_cache(maxsize=None)
def shared(kind: str) -> nn.Module:
    """One tiny model per family, shared by tests (do not mutate)."""
    return build(kind)


def prompt(length: int, seed: int = 0) -> List[int]:
    rng = np.random.default_rng(100 + seed)
    return [int(x) for x in rng.integers(0, VOCAB, size=length)]


# -- cache comparison -------------------------------------------------------------------------------------------
def _equal(a: Any, b: Any, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is empty"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    assert mx.array_equal(a, b).item(), f"{what}: differs by {mx.abs(a - b).max().item():.3g}"


def visible_kv(c: Any):
    """Keys and values a future query can attend to: all of a KV cache; a window cache's last window - 1."""
    k, v = c.keys_and_values() if isinstance(c, RotatingKVCache) else (c.keys[..., : c.offset, :],
                                                                          c.values[..., : c.offset, :])
    if isinstance(c, RotatingKVCache):
        n = min(c.offset, c.max_size - 1)
        k, v = k[..., k.shape[2] - n :, :], v[..., v.shape[2] - n :, :]
    return k, v


def assert_caches_equal(ours: Sequence[Any], ref: Sequence[Any]) -> None:
    """Every layer's cache state is bit-identical (see module docstring)."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert type(a) is type(b), f"layer {i}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, ArraysCache):
            _equal(a[0], b[0], f"layer {i} conv state")
            _equal(a[1], b[1], f"layer {i} recurrent state")
        elif isinstance(a, (KVCache, RotatingKVCache)):
            assert a.offset == b.offset, f"layer {i}: offset {a.offset} vs {b.offset}"
            if a.offset == 0:
                continue
            ka, va = visible_kv(a)
            kb, vb = visible_kv(b)
            _equal(ka, kb, f"layer {i} keys")
            _equal(va, vb, f"layer {i} values")
        else:
            raise TypeError(f"layer {i}: no comparison for {type(a).__name__}")
