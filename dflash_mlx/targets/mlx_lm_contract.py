"""What the layer walk reads from inside mlx-lm's models, named in one place.

The walk (`walk.py`) runs mlx-lm's own layers, but a few of its paths need more than a layer's call: the batched
pass restates plain attention from the module's projections, the GatedDeltaNet steps (`hybrid.py`, `tree.py`) run
the layer's math from its submodules, and Gemma 4's per-layer inputs come from two of its model's private helpers.
Those reads are listed here, by the kind of module they are made on, and Gemma 4's private calls are made only
here (`gemma4_per_layer_inputs`). `missing` says which of them a loaded model lacks, so an mlx-lm upgrade that moves
one fails loudly in `tests/test_mlx_lm_contract.py` (run over every family the tests build) rather than quietly
in a pass.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

# mlx-lm model modules whose decoder layers are exactly the pre-norm block `h = x + mix(norm1(x)); h + mlp(norm2(h))`
# (the walk splits them: `walk.splittable`), and those whose `Attention.__call__` is the plain one the batched pass
# restates (`walk.plain_attention`); tests/test_batching.py checks both against mlx-lm's own calls.
PRE_NORM_MODULES = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"}
PLAIN_ATTENTION_MODULES = {"llama", "qwen2", "qwen3", "qwen3_moe"}
# A decoder layer the walk may split into norm / mixer / MLP (`walk.splittable`).
PRE_NORM_LAYER = ("input_layernorm", "post_attention_layernorm", "mlp")
# mlx-lm's plain attention, restated by the batched pass (`walk.plain_attention`).
PLAIN_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
# A GatedDeltaNet mixer, run from its submodules (`hybrid.gated_delta_net`, `tree.gdn_tree`).
GATED_DELTA = ("conv_kernel_size", "conv_dim", "key_dim", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
               "A_log", "dt_bias", "conv1d", "norm", "out_proj")
# Gemma 4's text model: per-layer inputs and KV sharing (`gemma.py`).
GEMMA4_MODEL = ("_get_per_layer_inputs", "_project_per_layer_inputs", "previous_kvs", "hidden_size_per_layer_input",
                "embed_scale", "window_size", "embed_tokens")


def _lacks(obj, names: Tuple[str, ...]) -> List[str]:
    return [n for n in names if not hasattr(obj, n)]


def missing(target) -> Dict[str, List[str]]:
    """{what: names it lacks} for the wrapped `target` (a `TargetModel`); empty when everything the walk reads is
    where it expects it."""
    found: Dict[str, List[str]] = {}
    inner = target.inner
    if target.family.shares_kv:
        found["model"] = _lacks(inner, GEMMA4_MODEL)
    for i, layer in enumerate(inner.layers):
        module = type(layer).__module__.rsplit(".", 1)[-1]
        lacks = []
        if module in PRE_NORM_MODULES:
            lacks += _lacks(layer, PRE_NORM_LAYER)
        if getattr(layer, "is_linear", False):
            lacks += _lacks(getattr(layer, "linear_attn", None), GATED_DELTA)
        elif module in PLAIN_ATTENTION_MODULES:
            lacks += _lacks(getattr(layer, "self_attn", None), PLAIN_ATTENTION)
        if lacks:
            found[f"layer {i} ({type(layer).__name__})"] = lacks
    return {k: v for k, v in found.items() if v}


def gemma4_per_layer_inputs(inner: nn.Module, ids: mx.array, h: mx.array) -> mx.array:
    """Gemma 4's per-layer input embeddings [B, T, layers, D] for ids [B, T] and their scaled embedding h, as its
    model's own call computes them."""
    return inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids, inner.embed_tokens(ids)))
