"""The DFlash drafter's configuration, read from any published checkpoint generation.

z-lab checkpoints are Qwen3 configs plus DFlash keys. Older ones put `block_size` at the top level, newer ones
inside `dflash_config`; transformers-5 exports replace `rope_theta`/`rope_scaling` with `rope_parameters`.
`DFlashConfig.from_dict` accepts all of them; `to_dict` writes the one normalized form our converter emits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import DFlashError

DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Spread the tapped layers evenly from layer 1 to layer L-3, as the reference does."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    num_target_layers: Optional[int] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    target_layer_ids: Optional[List[int]] = None
    mask_token_id: Optional[int] = None
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    # Gemma-style knobs of newer checkpoints.
    input_embedding_scale: Optional[float] = None
    output_multiplier: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # Reduced draft vocabulary (speculators convention): the drafter owns an `lm_head` over this many tokens and a
    # `d2t` buffer, target id = draft id + d2t[draft id].
    draft_vocab_size: Optional[int] = None
    quantization: Optional[Dict[str, int]] = None
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None:
            if self.num_target_layers is None:
                raise DFlashError(
                    "drafter config has neither dflash_config.target_layer_ids nor num_target_layers; "
                    "add one of them to config.json"
                )
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(
                f"drafter config lists {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers; "
                "config.json is inconsistent: restore it from the drafter's source"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("drafter config has sliding_attention layers but no sliding_window; "
                              "config.json is incomplete: restore it from the drafter's source")
        if self.block_size < 1:
            raise DFlashError(f"drafter config has block_size {self.block_size}; it must be >= 1 (fix config.json)")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DFlashError(
                f"drafter config has draft_vocab_size {self.draft_vocab_size}, which must be between 1 and "
                f"vocab_size {self.vocab_size}; config.json is inconsistent: restore it from the drafter's source"
            )

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "DFlashConfig":
        """Build from a z-lab (either generation), speculators, or our own normalized config dict."""
        raw = dict(raw)
        layout = None
        if raw.get("speculators_model_type") == "dflash" or "transformer_layer_config" in raw:
            raw, layout = _flatten_speculators(raw), SPECULATORS
        dflash = dict(raw.get("dflash_config") or {})
        values: Dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for name in names:
            if name in dflash:
                values[name] = dflash[name]
            elif name in raw:
                values[name] = raw[name]
        rope = raw.get("rope_parameters")
        if rope:
            values.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
            if values.get("rope_scaling") is None and rope.get("rope_type", rope.get("type", "default")) != "default":
                values["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if values.get("rope_theta") is None:
            values.pop("rope_theta", None)
        missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if n not in values]
        if missing:
            raise DFlashError(f"drafter config.json lacks {', '.join(missing)}; is this a DFlash drafter?")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "block_size"):
            value = values.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DFlashError(f"drafter config has {name} = {value!r}; it must be a positive integer "
                                  "(fix config.json or restore it from the drafter's source)")
        ids = values.get("target_layer_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids) and ids):
            raise DFlashError(f"drafter config has target_layer_ids = {ids!r}; it must be a list of layer numbers")
        config = cls(**values)
        if layout is not None:
            config.extra["layout"] = layout  # the loader drops the tensors this packaging adds (`speculators_tensors`)
        return config

    def to_dict(self) -> Dict[str, Any]:
        """The normalized config our converter writes: every field explicit, DFlash keys in `dflash_config`."""
        out: Dict[str, Any] = {
            "model_type": "dflash",
            "architectures": ["DFlashDraftModel"],
        }
        dflash_keys = ("target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier",
                       "final_logit_softcapping")
        dflash = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name in dflash_keys:
                if value is not None:
                    dflash[f.name] = value
            elif value is not None:
                out[f.name] = value
        out["dflash_config"] = dflash
        return out


SPECULATORS = "speculators"
# Tensors a speculators DFlash checkpoint may carry beside the z-lab ones: copies of the target's embedding, final
# norm and head, and the target-to-draft vocabulary mask. The drafter uses the target's own; these are dropped.
SPECULATORS_ONLY = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight", "t2d")


def _flatten_speculators(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Map the vLLM speculators DFlash format onto z-lab keys: the Qwen3 layer config nested under
    `transformer_layer_config`, taps in `aux_hidden_state_layer_ids` (z-lab ids + 1), an optional reduced draft
    vocabulary (`draft_vocab_size`, its own `lm_head` and `d2t`), `sliding_window_non_causal` for sliding layers."""
    if raw.get("sample_from_anchor"):
        raise DFlashError("this speculators DFlash drafter predicts from its anchor slot (sample_from_anchor: true), "
                          "which DFlash decoding does not do; use a drafter trained with sample_from_anchor false")
    inner = raw.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise DFlashError("speculators DFlash config.json lacks its transformer_layer_config; restore it from the "
                          "drafter's source")
    out = {**inner}
    aux = raw.get("aux_hidden_state_layer_ids")
    out["dflash_config"] = {
        "target_layer_ids": [i - 1 for i in aux] if isinstance(aux, list) else aux,
        "mask_token_id": raw.get("mask_token_id"),
    }
    out["dflash_config"] = {k: v for k, v in out["dflash_config"].items() if v is not None}
    for key in ("block_size", "num_target_layers"):
        if key in raw:
            out[key] = raw[key]
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != inner.get("vocab_size"):  # equal: the target's own head
        out["draft_vocab_size"] = draft_vocab
    if raw.get("sliding_window_non_causal"):
        out["is_causal"] = False  # full-attention layers see the whole block anyway
    return out
