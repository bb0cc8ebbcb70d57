"""EAGLE-3 drafter configs of both published layouts, and our own, normalized into one `Eagle3Config`.

- **speculators** (vLLM; `speculators_model_type: "eagle3"`): the decoder layer's Llama config under
  `transformer_layer_config`, the reduced `draft_vocab_size`, `norm_before_residual`, and the tapped layers in
  `eagle_aux_hidden_state_layer_ids`, counted as vLLM captures them: id i is the hidden state *entering* target
  layer i, i.e. the output of layer i - 1.
- **SpecForge / SGLang** (`architectures: ["LlamaForCausalLMEagle3"]`): a flat Llama config with
  `draft_vocab_size`, and the taps (when stated) in `eagle_config.eagle_aux_hidden_state_layer_ids`, counted as
  layer *outputs* (SGLang adds one before capturing at a layer's input).
- **ours** (`model_type: "eagle3"`, written by `convert`): every field at the top level, taps as layer outputs.

`target_layer_ids` are layer outputs, as everywhere in this package. Where a checkpoint leaves them unstated they
are None until the drafter meets its target: then the family's published default applies (vLLM and SGLang both
capture the inputs of layers 2, N // 2 and N - 3 of an N-layer target, i.e. the outputs of 1, N // 2 - 1, N - 4).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import DFlashError

MODEL_TYPE = "eagle3"
DEFAULT_BLOCK_SIZE = 4  # widest pass: 3 drafts, the speculators default of `speculative_tokens`
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "vocab_size", "attention_bias", "mlp_bias", "tie_word_embeddings")


def default_taps(num_target_layers: int) -> List[int]:
    """The layers vLLM and SGLang tap when a drafter names none (as outputs of layers 1, N//2 - 1, N - 4)."""
    n = num_target_layers
    return [max(0, min(n - 1, i - 1)) for i in (2, n // 2, n - 3)]


def is_eagle3(raw: Dict[str, Any]) -> bool:
    """An EAGLE-3 config of any layout (a Llama config with a `draft_vocab_size` is one: some releases name a
    plain Llama architecture)."""
    archs = raw.get("architectures") or []
    return (raw.get("model_type") == MODEL_TYPE or raw.get("speculators_model_type") == MODEL_TYPE
            or (raw.get("speculators_config") or {}).get("algorithm") == MODEL_TYPE
            or any("Eagle3" in a for a in archs)
            or (raw.get("model_type") == "llama" and "draft_vocab_size" in raw and "dflash_config" not in raw))


@dataclass
class Eagle3Config:
    hidden_size: int  # the drafter's (its layer's width)
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    num_hidden_layers: int = 1
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    mlp_bias: bool = False
    target_hidden_size: Optional[int] = None  # the target's, when it differs from the drafter's
    draft_vocab_size: Optional[int] = None  # a reduced head of this many ids, mapped by `d2t`
    norm_before_residual: bool = False  # the layer's residual is the normed fused state (some speculators heads)
    norm_before_fc: bool = False  # an RMSNorm over the concatenated taps before `fc`
    tie_word_embeddings: bool = False
    target_layer_ids: Optional[List[int]] = None  # layer outputs; None: the default, set against the target
    taps_stated: bool = True  # False: `target_layer_ids` came from the default, not from the checkpoint
    block_size: int = DEFAULT_BLOCK_SIZE  # widest pass (drafts + 1)
    has_own_embed: bool = False  # the checkpoint's embedding is used only where the target's cannot be
    has_own_lm_head: bool = True
    layout: str = "ours"  # "speculators", "specforge" or "ours": for --verbose and errors
    quantization: Optional[Dict[str, int]] = None
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    # What the pairing check and the engine read of every drafter config.
    mask_token_id = None  # drafts autoregressively: no mask token
    needs_mask = False
    num_target_layers = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.draft_vocab_size == self.vocab_size:
            self.draft_vocab_size = None  # the whole vocabulary: no mapping
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DFlashError(f"EAGLE-3 drafter config has draft_vocab_size {self.draft_vocab_size}, which must be "
                              f"between 1 and vocab_size {self.vocab_size}; restore config.json from its source")
        if self.block_size < 2:
            raise DFlashError(f"EAGLE-3 drafter config has block_size {self.block_size}; it must be >= 2")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if len(self.target_layer_ids) < 1:
                raise DFlashError("EAGLE-3 drafter config lists no tapped layers; restore config.json")

    @property
    def num_taps(self) -> int:
        return 3 if self.target_layer_ids is None else len(self.target_layer_ids)

    @property
    def own_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def fit_taps(self, num_target_layers: int) -> bool:
        """Set the default taps for an N-layer target where the checkpoint states none; True if it did."""
        if self.target_layer_ids is not None:
            return False
        self.target_layer_ids = default_taps(num_target_layers)
        self.taps_stated = False
        return True

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "Eagle3Config":
        """Any EAGLE-3 layout (see the module docstring) into an `Eagle3Config`."""
        if raw.get("model_type") == MODEL_TYPE and not raw.get("speculators_model_type"):
            names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
            return _build({k: v for k, v in raw.items() if k in names})
        if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
            return _build(_speculators(raw))
        return _build(_specforge(raw))

    def to_dict(self) -> Dict[str, Any]:
        """Our normalized form: every field at the top level, `model_type: "eagle3"`."""
        out: Dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["Eagle3DraftModel"]}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None:
                out[f.name] = value
        out.pop("taps_stated", None)
        if not self.taps_stated:  # a default fitted to one target is not the checkpoint's: keep it unstated
            out.pop("target_layer_ids", None)
        return out


def _rope(values: Dict[str, Any], layer: Dict[str, Any]) -> None:
    """transformers-5 `rope_parameters` into `rope_theta` / `rope_scaling`."""
    rope = layer.get("rope_parameters")
    if rope:
        values.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if values.get("rope_scaling") is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            values["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}


def _layer_values(layer: Dict[str, Any]) -> Dict[str, Any]:
    values = {k: layer[k] for k in _LAYER_KEYS if layer.get(k) is not None}
    _rope(values, layer)
    return values


def _speculators(raw: Dict[str, Any]) -> Dict[str, Any]:
    layer = dict(raw.get("transformer_layer_config") or {})
    values = _layer_values(layer)
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc"):
        if raw.get(key) is not None:
            values[key] = raw[key]
    if raw.get("tie_word_embeddings") is not None:
        values["tie_word_embeddings"] = raw["tie_word_embeddings"]
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        _check_ids(aux)
        values["target_layer_ids"] = [int(i) - 1 for i in aux]  # the input of layer i is the output of i - 1
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    k = methods[0].get("speculative_tokens") if methods else None
    if k is not None:
        values["block_size"] = int(k) + 1
    values["layout"] = "speculators"
    return values


def _specforge(raw: Dict[str, Any]) -> Dict[str, Any]:
    values = _layer_values(raw)
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc"):
        if raw.get(key) is not None:
            values[key] = raw[key]
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        _check_ids(aux)
        values["target_layer_ids"] = [int(i) for i in aux]  # layer outputs already (SGLang adds 1 to capture)
    values["layout"] = "specforge"
    return values


def _check_ids(ids) -> None:
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise DFlashError(f"EAGLE-3 drafter config has eagle_aux_hidden_state_layer_ids = {ids!r}; it must be a "
                          "list of layer numbers (restore config.json from the drafter's source)")


def _build(values: Dict[str, Any]) -> Eagle3Config:
    missing = [n for n in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
               if n not in values]
    if missing:
        raise DFlashError(f"EAGLE-3 drafter config.json lacks {', '.join(missing)}; restore it from the "
                          "drafter's source")
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "block_size", "draft_vocab_size", "target_hidden_size"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DFlashError(f"EAGLE-3 drafter config has {name} = {value!r}; it must be a positive integer "
                              "(fix config.json or restore it from the drafter's source)")
    if values.get("rope_theta") is None:
        values.pop("rope_theta", None)
    return Eagle3Config(**values)
