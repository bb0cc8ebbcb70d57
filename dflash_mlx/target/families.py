"""How to run each supported mlx-lm architecture one layer at a time.

A `Family` says where the decoder stack lives inside an mlx-lm `Model`, how tokens are embedded, which attention
mask each layer gets, and how the final hidden state becomes logits. Everything else (the layers, caches and
weights) is mlx-lm's own. The adapter's load-time parity probe checks each family against the model's own call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask


def _inner(model: nn.Module) -> nn.Module:
    return model.model


def _embed(model: nn.Module, inner: nn.Module, ids: mx.array) -> mx.array:
    return inner.embed_tokens(ids)


def _head(model: nn.Module, inner: nn.Module, h: mx.array) -> mx.array:
    # Untied models carry `lm_head`; tied ones reuse the embedding (quantized or not) as a linear map.
    if "lm_head" in model:
        return model.lm_head(h)
    return inner.embed_tokens.as_linear(h)


def _one_mask(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    mask = create_attention_mask(h, cache[0])
    return [mask] * len(inner.layers)


def _llama_masks(inner: nn.Module, h: mx.array, cache: List[Any]) -> List[Any]:
    # Llama-style configs may mix full and sliding-window layers (`layer_types`).
    full = create_attention_mask(h, cache[inner.fa_idx])
    if inner.swa_idx is None:
        return [full] * len(inner.layers)
    window = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [window if layer.use_sliding else full for layer in inner.layers]


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


FAMILIES: List[Family] = [
    Family("llama", ("llama", "mistral"), layer_masks=_llama_masks),
    Family("qwen2", ("qwen2",)),
    Family("qwen3", ("qwen3",)),
]

_BY_TYPE: Dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> List[str]:
    return sorted(_BY_TYPE)


def family_for(model_type: Optional[str]) -> Optional[Family]:
    return _BY_TYPE.get(model_type or "")
