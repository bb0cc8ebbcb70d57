"""The attributes and helpers of mlx-lm's models that the layer walk reads (targets/mlx_lm_contract.py) are where it
expects them, on every target family the tests build: an mlx-lm upgrade that moves one fails here, by name."""

import pytest

import tiny
from cache_compare import CONFIGS, shared
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.mlx_lm_contract import missing

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text", "gemma4_text", "qwen3_moe",
            "deepseek_v3", "llama", "qwen2", "qwen3", "llama_swa")


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_read_of_mlx_lm_internals_finds_its_attribute(kind):
    model = shared(kind) if kind in CONFIGS else tiny.target(kind)
    assert missing(TargetModel(model)) == {}


def test_a_moved_attribute_is_named():
    t = TargetModel(tiny.target("qwen3"))
    attn = t.inner.layers[1].self_attn
    saved = attn.n_kv_heads
    del attn.n_kv_heads
    try:
        assert missing(t) == {"layer 1 (TransformerBlock)": ["n_kv_heads"]}
    finally:
        attn.n_kv_heads = saved
