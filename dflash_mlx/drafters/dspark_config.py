"""The DSpark drafter's configuration: every published packaging read into one normalized form.

DSpark (DeepSeek DeepSpec) drafters are DFlash-style block drafters with their own embedding and LM head, a
sequential low-rank Markov head (`markov_w2(markov_w1[previous token])` added to each slot's logits) and an
optional confidence head. They ship in several packagings that describe the same model with different keys:

- DeepSpec (deepseek-ai/dspark_*): DSpark fields at the top level of a Qwen3 config.
- SpecForge (`dflash_config.projector_type: "dspark"`): ids nested in `dflash_config`; its declared YaRN rope
  (`rope_parameters`) is real and honoured.
- vLLM speculators (`speculators_config.algorithm: "dspark"`): the backbone under `transformer_layer_config`,
  taps in `aux_hidden_state_layer_ids` (the same layer numbers as DeepSpec's `target_layer_ids`), an optional
  reduced draft vocabulary (`draft_vocab_size` plus a `d2t` tensor).
- LiquidAI LFM2.5 (`architectures: [...DSpark...]`, ids nested in an untagged `dflash_config`; an explicit
  `rope_is_neox_style: false` means interleaved rope).
- NVIDIA Nemotron (DFlash lineage, DeepSpec top-level fields plus `dflash_query_causal` / `dflash_config.causal`:
  a causal block; `sliding_window` / `dflash_config.use_swa` + `swa_window_size`: a window over the context;
  `attention_sink_bias`: a learned per-head sink logit; `has_lm_head: false`: the target's LM head;
  `sample_from_anchor: false`: slot 0 is a pure anchor). These map onto the DFlash fields `is_causal`,
  `sliding_window` / `layer_types` and our `attention_sink`.

Which slot predicts first (`logits_start`) differs: DeepSpec, SpecForge and LFM2 heads predict from the anchor
slot too (0: a 7-wide block gives 7 drafts); speculators heads derive it from `speculative_tokens` (or
`sample_from_anchor`) and default to 1. Reading from the wrong slot shifts every draft by one position and
roughly halves acceptance without any error, so it is settled here, once, per packaging.

Normalized block size: `block_size` is the engine's widest verify pass = drafts + 1, i.e.
`dspark_block + 1 - logits_start`, where `dspark_block` is the width the drafter was trained on (DeepSpec block 7
-> 7 drafts -> `block_size` 8). The drafter always runs its full trained block (it is bidirectional, so a shorter
block would change every slot) and hands the engine the first `width - 1` drafts.

Backbones: Qwen3 layers (every packaging above), or Gemma-4 layers (`model_type: gemma4_text`, e.g.
deepseek-ai/dspark_gemma4_12b_block7; `dspark_layers.py`): normalized with `backbone: "gemma4"`, `head_dim` = the
global head dim, `num_key_value_heads` = the global KV heads when `attention_k_eq_v`, the proportional rope in
`rope_scaling`, and the soft-cap 30 unless the config says otherwise.

Not supported yet, each refused with one line naming the key: qwen3_5 backbones (gated q, offset norms, partial
rope), GIDD log-SNR conditioning, non-vanilla Markov heads, DFlash-lineage markers on a Gemma-4 backbone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import DFlashError
from .config import DFlashConfig

MODEL_TYPE = "dspark"  # the model_type our converter writes


def is_dspark(raw: Dict[str, Any]) -> bool:
    """Whether a raw config.json describes a DSpark drafter in any packaging (or our normalized form)."""
    spec = raw.get("speculators_config") or {}
    archs = " ".join(raw.get("architectures") or [])
    return (raw.get("model_type") == MODEL_TYPE
            or "markov_rank" in raw
            or raw.get("speculators_model_type") == "dspark"
            or spec.get("algorithm") == "dspark"
            or (raw.get("dflash_config") or {}).get("projector_type") == "dspark"
            or "DSpark" in archs
            or any(k.startswith("dspark_") for k in raw))


@dataclass
class DSparkConfig(DFlashConfig):
    dspark_block: int = 7  # block width the drafter was trained on (anchor + masks)
    logits_start: int = 0  # first block slot whose logits are a draft (0: the anchor slot predicts too)
    markov_rank: int = 0  # 0 = no Markov head
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    rope_traditional: bool = False  # interleaved (GPT-J) rope instead of split-half
    has_own_embed: bool = True  # False: the drafter embeds the block with the target's embedding
    has_own_lm_head: bool = True  # False: the drafter projects with the target's LM head
    attention_sink: bool = False  # a learned per-head logit in every attention softmax's denominator (Nemotron)
    backbone: str = "qwen3"  # the draft layers: "qwen3" (drafters.dflash.DraftLayer) or "gemma4" (dspark_layers)
    attention_k_eq_v: bool = False  # Gemma-4: values are the (un-roped, weightless-normed) key projection
    packaging: str = "deepspec"  # where the checkpoint came from, for --verbose and errors

    def __post_init__(self):
        super().__post_init__()
        if self.logits_start not in (0, 1):
            raise DFlashError(f"DSpark drafter config has logits_start {self.logits_start}; it must be 0 or 1 "
                              "(fix config.json)")
        if self.dspark_block - self.logits_start < 1:
            raise DFlashError(f"DSpark drafter config has block_size {self.dspark_block} with logits_start "
                              f"{self.logits_start}: no slot predicts; config.json is inconsistent")
        want = self.dspark_block + 1 - self.logits_start
        if self.block_size != want:
            raise DFlashError(f"DSpark drafter config has block_size {self.block_size} but dspark_block "
                              f"{self.dspark_block} and logits_start {self.logits_start} give {want}; "
                              "config.json is inconsistent: convert the drafter again")
        if self.sliding_window and self.sliding_window < self.dspark_block:
            # Our block attention windows only the context; a window narrower than the block would cut block keys.
            raise DFlashError(f"DSpark drafter config has sliding_window {self.sliding_window} narrower than its "
                              f"block ({self.dspark_block}); such a head is not supported, use plain decoding")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise DFlashError("DSpark drafter config has confidence_head_with_markov but markov_rank 0; "
                              "config.json is inconsistent: restore it from the drafter's source")

    @property
    def max_drafts(self) -> int:
        return self.dspark_block - self.logits_start

    @property
    def out_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "DSparkConfig":
        """Any DSpark packaging, or our normalized form, into a `DSparkConfig`."""
        if raw.get("model_type") == MODEL_TYPE:
            names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
            return _build(cls, {k: v for k, v in raw.items() if k in names})
        return _build(cls, normalize(raw))

    def to_dict(self) -> Dict[str, Any]:
        """Our normalized form: every field at the top level, `model_type: "dspark"`."""
        out: Dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["DSparkDraftModel"]}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None:
                out[f.name] = value
        return out


def _build(cls, values: Dict[str, Any]) -> DSparkConfig:
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "block_size", "dspark_block"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DFlashError(f"DSpark drafter config has {name} = {value!r}; it must be a positive integer "
                              "(fix config.json or restore it from the drafter's source)")
    try:
        return cls(**values)
    except TypeError as e:
        raise DFlashError(f"DSpark drafter config.json is incomplete ({e}); restore it from the drafter's source")


def _refuse(key: str, value: Any, what: str) -> DFlashError:
    return DFlashError(f"DSpark drafter config has {key} = {value!r}: {what} is not supported yet; "
                       "use a DFlash drafter or plain decoding for this target")


def _flatten_speculators(c: Dict[str, Any]) -> Dict[str, Any]:
    """The speculators schema in DeepSpec keys; `logits_start` from the declared proposal width."""
    tlc = c.get("transformer_layer_config")
    taps = c.get("aux_hidden_state_layer_ids")
    if not tlc or not taps:
        key = "transformer_layer_config" if not tlc else "aux_hidden_state_layer_ids"
        raise DFlashError(f"speculators DSpark config.json lacks {key}; restore it from the drafter's source")
    out = dict(tlc)
    out["target_layer_ids"] = list(taps)  # DeepSpec's numbering already (no shift, unlike speculators DFlash)
    for k in ("block_size", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov", "final_logit_softcapping", "draft_vocab_size",
              "attention_sink_bias", "num_target_layers"):
        if k in c:
            out[k] = c[k]
    lt = tlc.get("layer_types") or []
    if "sliding_attention" in lt and tlc.get("use_sliding_window") and tlc.get("sliding_window"):
        out["sliding_window"] = tlc["sliding_window"]
        # A sliding backbone is causal in the block unless it says otherwise (the DFlash convention).
        out["dflash_query_causal"] = not bool(c.get("sliding_window_non_causal", False))
    props = (c.get("speculators_config") or {}).get("proposal_methods") or []
    spec_tokens = props[0].get("speculative_tokens") if props else None
    block = out.get("block_size")
    start = 1  # heads that predate both fields reserve slot 0 as a pure anchor
    if spec_tokens and block and 0 <= block - spec_tokens < block:
        start = block - spec_tokens
    elif isinstance(c.get("sample_from_anchor"), bool):
        start = 0 if c["sample_from_anchor"] else 1
    out["logits_start"] = start
    out["_packaging"] = "speculators"
    return out


def normalize(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The `DSparkConfig` fields a published packaging describes (refusing what the drafter cannot run)."""
    c = dict(raw)
    spec = c.get("speculators_config") or {}
    if "speculators_config" in c or "speculators_model_type" in c:
        algo = c.get("speculators_model_type") or spec.get("algorithm")
        if algo != "dspark":
            raise DFlashError(f"speculators config has algorithm {algo!r}, not 'dspark'")
        c = _flatten_speculators(c)
    packaging = c.pop("_packaging", "deepspec")
    if "block_size" not in c and any(k.startswith("dspark_") for k in c):
        key = next(k for k in c if k.startswith("dspark_"))
        raise DFlashError(f"config.json has {key} but no block_size: this is a target model with a built-in "
                          "DSpark drafter, not a standalone drafter checkpoint; pass the drafter's own repo")
    nested = c.get("dflash_config") or {}
    if nested.get("projector_type") == "dspark":
        packaging = "specforge"
    elif "target_layer_ids" not in c and nested.get("target_layer_ids") is not None:
        packaging = "lfm2"
    if packaging in ("specforge", "lfm2"):
        for k in ("target_layer_ids", "mask_token_id", "num_target_layers"):
            if k not in c and nested.get(k) is not None:
                c[k] = nested[k]
        c.setdefault("logits_start", 0)

    mt = str(c.get("model_type", ""))
    gemma = "gemma4" in mt
    if mt == "qwen3_5" or c.get("enable_qwen35_gated_q_proj"):
        raise _refuse("model_type", mt, "a qwen3_5 DSpark backbone (gated q, offset norms)")
    if mt and "qwen3" not in mt and not gemma:
        raise DFlashError(f"DSpark drafter config has model_type {mt!r}; only Qwen3 and Gemma-4 backbones are "
                          "supported")
    if c.get("log_snr_conditioning"):
        raise _refuse("log_snr_conditioning", c["log_snr_conditioning"], "GIDD log-SNR conditioning")
    if c.get("markov_head_type", "vanilla") != "vanilla":
        raise _refuse("markov_head_type", c["markov_head_type"], "this Markov head type")

    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
                           "num_attention_heads", "block_size", "mask_token_id", "target_layer_ids") if k not in c]
    if missing:
        raise DFlashError(f"DSpark drafter config.json lacks {', '.join(missing)}; restore it from the drafter's "
                          "source")

    if "logits_start" in c:
        start = int(c["logits_start"])
    elif isinstance(c.get("sample_from_anchor"), bool):
        start = 0 if c["sample_from_anchor"] else 1
    else:
        start = 0
    # DFlash-lineage block attention (Nemotron). A Qwen3 config copied from the target often carries a
    # `sliding_window` it never uses, so (as mlx-dspark does) a window counts only beside another DFlash marker.
    causal = bool(c.get("dflash_query_causal") or nested.get("causal"))
    sink = bool(c.get("attention_sink_bias"))
    if packaging == "deepspec" and (causal or sink):
        packaging = "nemotron"
    window = None
    if causal or sink or nested or packaging == "speculators":
        w = c.get("sliding_window") or (nested.get("swa_window_size") if nested.get("use_swa") else None)
        window = int(w) if w else None
    rp = c.get("rope_parameters") or {}
    rope_scaling: Optional[Dict[str, Any]] = None
    yarn = rp if rp.get("rope_type") == "yarn" else (c.get("rope_scaling") or {})
    if packaging == "specforge" and (yarn.get("rope_type") or yarn.get("type")) == "yarn" and yarn.get("factor"):
        # Only SpecForge builds its rope from the head's own config; elsewhere the field is the target's, copied.
        rope_scaling = {"rope_type": "yarn", "factor": float(yarn["factor"])}
        for k in ("beta_fast", "beta_slow", "original_max_position_embeddings"):
            if k in yarn:
                rope_scaling[k] = yarn[k]
    draft_vocab = c.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) == int(c["vocab_size"]):
        draft_vocab = None  # declared but not reduced: no d2t table ships
    block = int(c["block_size"])
    heads = c["num_attention_heads"]
    values = dict(
        hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads), intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"], head_dim=c.get("head_dim"), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=rp.get("rope_theta", c.get("rope_theta", 1_000_000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=c.get("max_position_embeddings", 40960),
        attention_bias=bool(c.get("attention_bias", False)),
        num_target_layers=c.get("num_target_layers"), target_layer_ids=list(c["target_layer_ids"]),
        mask_token_id=c["mask_token_id"], final_logit_softcapping=c.get("final_logit_softcapping"),
        draft_vocab_size=draft_vocab, dspark_block=block, logits_start=start, block_size=block + 1 - start,
        markov_rank=int(c.get("markov_rank", 256)),
        enable_confidence_head=bool(c.get("enable_confidence_head", True)),
        confidence_head_with_markov=bool(c.get("confidence_head_with_markov", True)),
        rope_traditional=("rope_is_neox_style" in c and not c["rope_is_neox_style"]),
        has_own_lm_head=bool(c.get("has_lm_head", True)), packaging=packaging,
        is_causal=causal, sliding_window=window, attention_sink=sink,
        layer_types=["sliding_attention" if window else "full_attention"] * c["num_hidden_layers"],
    )
    if gemma:
        if causal or sink or window:
            key = "attention_sink_bias" if sink else "dflash_query_causal" if causal else "sliding_window"
            raise _refuse(key, c.get(key, True), "a DFlash-lineage block on a Gemma-4 backbone")
        values.update(_gemma4(c))
    return values


def _gemma4(c: Dict[str, Any]) -> Dict[str, Any]:
    """A Gemma-4 backbone's attention shape, rope and soft-cap (the defaults are mlx-dspark's, i.e. the 12B head's)."""
    rope = (c.get("rope_parameters") or {}).get("full_attention") or {}
    k_eq_v = bool(c.get("attention_k_eq_v", True))
    proportional = rope.get("rope_type", "proportional") == "proportional"
    return dict(
        backbone="gemma4", attention_k_eq_v=k_eq_v, head_dim=c.get("global_head_dim", 512),
        num_key_value_heads=c.get("num_global_key_value_heads", 1) if k_eq_v else c.get("num_key_value_heads", 8),
        rope_theta=rope.get("rope_theta", 1_000_000.0), rope_scaling=(
            {"rope_type": "proportional", "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25)}
            if proportional else None),
        final_logit_softcapping=c.get("final_logit_softcapping", 30.0),
    )
