"""How to run each supported mlx-lm architecture one layer at a time (the walk itself is `walk.walk`).

A `Family` says where the decoder stack lives inside an mlx-lm `Model` (also under `language_model` for the
multimodal layouts), how tokens are embedded, which attention mask each layer gets, how a layer is called and how
the final hidden state becomes logits. Everything else (the layers, caches and weights) is mlx-lm's own. The
adapter's load-time parity probe checks each family against the model's own call.

Families: dense (llama, mistral, qwen2, qwen3), MoE through mlx-lm's switch layers (qwen3_moe, gpt_oss,
deepseek_v3, kimi_k25, minimax), hybrid GatedDeltaNet (qwen3_5, qwen3_5_moe, qwen3_next; see `hybrid.py`),
sliding-window and sink attention (gpt_oss, gemma3, gemma4, llama with `layer_types`; see `rotating.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, gather_last_axis

from .hybrid import hybrid_call_layer


def text_lm(model: nn.Module) -> nn.Module:
    """The text language model: the model itself, or its `language_model` in multimodal layouts."""
    return model["language_model"] if "language_model" in model else model


def _inner(lm: nn.Module) -> nn.Module:
    return lm.model


def _embed(lm: nn.Module, inner: nn.Module, ids: mx.array) -> mx.array:
    return inner.embed_tokens(ids)


def _head(lm: nn.Module, inner: nn.Module, h: mx.array) -> mx.array:
    # Untied models carry `lm_head`; tied ones reuse the embedding (quantized or not) as a linear map.
    # A final logit soft-cap, where the model has one, is applied by the adapter.
    if "lm_head" in lm:
        group = getattr(lm, "sharding_group", None)  # a tensor-parallel head computes this rank's vocab slice
        return lm.lm_head(h) if group is None else gather_last_axis(lm.lm_head(h), group)
    return inner.embed_tokens.as_linear(h)


def _one_mask(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    mask = create_attention_mask(h, cache[0])
    return [mask] * len(inner.layers)


def _array_mask(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    # deepseek_v3's MLA attention wants a boolean array (it masks its rope scores itself).
    mask = create_attention_mask(h, cache[0], return_array=True)
    return [mask] * len(inner.layers)


def _split_masks(h: mx.array, cache: List[Any], sliding: List[bool], window: Optional[int]) -> List[Any]:
    """Full-attention layers share one mask, sliding-window layers another (each built from its own cache)."""
    masks = {}
    for is_sliding in (False, True):
        first = next((i for i, s in enumerate(sliding) if s == is_sliding), None)
        if first is not None:
            masks[is_sliding] = create_attention_mask(h, cache[first], window_size=window if is_sliding else None)
    return [masks[s] for s in sliding]


def _llama_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    # Llama-style configs may mix full and sliding-window layers (`layer_types`).
    sliding = [bool(getattr(layer, "use_sliding", False)) for layer in inner.layers]
    return _split_masks(h, cache, sliding, getattr(inner, "sliding_window", None))


def _gpt_oss_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    sliding = [t == "sliding_attention" for t in inner.layer_types]
    return _split_masks(h, cache, sliding, inner.window_size)


def _gemma3_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    sliding = [layer.self_attn.is_sliding for layer in inner.layers]
    return _split_masks(h, cache, sliding, inner.window_size)


def _hybrid_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    linear = [layer.is_linear for layer in inner.layers]
    attn = next((i for i, lin in enumerate(linear) if not lin), None)
    ssm = next((i for i, lin in enumerate(linear) if lin), None)
    fa_mask = create_attention_mask(h, cache[attn]) if attn is not None else None
    ssm_mask = create_ssm_mask(h, cache[ssm]) if ssm is not None else None
    return [ssm_mask if lin else fa_mask for lin in linear]


def _gemma3_embed(lm: nn.Module, inner: nn.Module, ids: mx.array) -> mx.array:
    h = inner.embed_tokens(ids)
    # As mlx-lm does it: the sqrt(hidden) scale rounded to bf16 first.
    return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def _call_layer(layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
    return layer(h, mask, cache)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple
    inner: Callable[[nn.Module], nn.Module] = _inner
    embed: Callable[[nn.Module, nn.Module, mx.array], mx.array] = _embed
    layer_masks: Callable[[nn.Module, mx.array, List[Any]], List[Any]] = _one_mask
    call_layer: Callable[[nn.Module, mx.array, Any, Any], mx.array] = _call_layer
    head: Callable[[nn.Module, nn.Module, mx.array], mx.array] = _head
    # Whether the model's ArraysCache layers are GatedDeltaNet layers this package can roll back.
    gated_delta: bool = False
    # Per-layer inputs computed from the ids and the embedding (Gemma 4), as a list by layer, or None.
    layer_inputs: Optional[Callable[[nn.Module, mx.array, mx.array], List[mx.array]]] = None
    # Layers that reuse an earlier layer's keys and values (Gemma 4): called through `call_shared`, which threads
    # that state between a segment's layers (`walk.walk`).
    shares_kv: bool = False
    call_shared: Optional[Callable[..., mx.array]] = None


def _gemma4_family() -> Family:
    from .gemma import gemma4_call, gemma4_embed, gemma4_layer_inputs, gemma4_masks

    return Family("gemma4", ("gemma4", "gemma4_text"), embed=gemma4_embed, layer_masks=gemma4_masks,
                  layer_inputs=gemma4_layer_inputs, shares_kv=True, call_shared=gemma4_call)


FAMILIES: List[Family] = [
    Family("llama", ("llama", "mistral"), layer_masks=_llama_masks),
    Family("qwen2", ("qwen2",)),
    Family("qwen3", ("qwen3",)),
    Family("qwen3_moe", ("qwen3_moe",)),
    Family("minimax", ("minimax",)),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k25"), layer_masks=_array_mask),
    Family("gpt_oss", ("gpt_oss",), layer_masks=_gpt_oss_masks),
    Family("gemma3", ("gemma3", "gemma3_text"), embed=_gemma3_embed, layer_masks=_gemma3_masks),
    _gemma4_family(),
    Family("qwen3_5", ("qwen3_5", "qwen3_5_moe", "qwen3_next"), layer_masks=_hybrid_masks,
           call_layer=hybrid_call_layer, gated_delta=True),
]

_BY_TYPE: Dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> List[str]:
    return sorted(_BY_TYPE)


def family_for(model_type: Optional[str]) -> Optional[Family]:
    return _BY_TYPE.get(model_type or "")
