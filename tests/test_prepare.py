"""`api.prepare` binds a drafter to its target: the Gemma knobs compose as cap(multiplier * uncapped head)."""

import mlx.core as mx
import pytest

from cache_compare import VOCAB, randomize, shared
from dflash_mlx.api import prepare
from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.drafters.dflash import DFlashDrafter


def _drafter(hidden: int, layers: int, **knobs) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=VOCAB, head_dim=16, block_size=4,
                       target_layer_ids=[0, layers - 1], mask_token_id=VOCAB - 1, **knobs)
    return randomize(DFlashDrafter(cfg), seed=3)


@pytest.mark.parametrize("own_cap", [None, 5.0])
def test_softcap_applies_once_after_the_multiplier(own_cap):
    model = shared("gemma4_text")
    probe = prepare(model, None)
    drafter = _drafter(probe.hidden_size, probe.num_layers, output_multiplier=4.0, final_logit_softcapping=own_cap)
    target = prepare(model, drafter)
    cache = drafter.make_cache()
    drafter.append_context(mx.ones((1, 3, drafter.config.num_taps * target.hidden_size)), cache)
    block = mx.array([[3] + [VOCAB - 1] * 3], dtype=mx.int32)
    logits = drafter(block, cache)

    # The same forward by hand: the uncapped target head, times the multiplier, then one cap.
    x = target.embed(block)
    for layer, c in zip(drafter.layers, cache):
        x = layer(x, c)
    raw = target.head(drafter.norm(x[:, 1:]), softcap=False) * 4.0
    cap = own_cap if own_cap is not None else target.final_logit_softcapping
    assert cap
    assert mx.allclose(logits, mx.tanh(raw / cap) * cap, atol=1e-5).item()
