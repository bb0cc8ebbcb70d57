"""The Gemma-4 backbone of DSpark drafters (deepseek-ai/dspark_gemma4_*): its attention and decoder layer.

Same job as `drafters.dflash.DraftLayer` (the block attends to the fused target context in a KV cache and to itself,
bidirectionally), with the Gemma-4 layer's shape as DeepSpec trains it and mlx-dspark ports it:

- attention at the global head dim with `num_global_key_value_heads`; with `attention_k_eq_v` there is no
  `v_proj`: the values are the un-roped key projection, RMS-normed without a weight (`v_norm`);
- proportional (partial) rope; q and k are RMS-normed and the attention scale is 1 (the norms set it);
- sandwich norms (pre/post attention, pre/post feed-forward) and a learned `layer_scalar` on the layer output;
- a gelu-tanh MLP.

The embedding scale (sqrt(hidden)) and the default logit soft-cap (30) are the drafter's (`dspark.py`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..metal.block_attention import block_attention
from .dspark_config import DSparkConfig


class Gemma4DraftAttention(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim  # head_dim: the global head dim (normalized)
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.k_eq_v = config.attention_k_eq_v
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.eps = config.rms_norm_eps
        self.rope = initialize_rope(hd, config.rope_theta, config.rope_traditional, config.rope_scaling,
                                    config.max_position_embeddings)
        # Gemma-4's draft block is bidirectional over the whole context (the engine's drafter protocol asks).
        self.block_causal, self.sliding_window = False, None

    def _kv(self, x: mx.array):
        """Normed (un-roped) keys and values [1, Hkv, S, D] of x [1, S, H]."""
        S = x.shape[1]
        kp = self.k_proj(x).reshape(1, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        vp = kp if self.k_eq_v else self.v_proj(x).reshape(1, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.k_norm(kp), mx.fast.rms_norm(vp, None, self.eps)

    def append_context(self, ctx: mx.array, cache: KVCache) -> None:
        k, v = self._kv(ctx)
        cache.update_and_fetch(self.rope(k, offset=cache.offset), v)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        _, B, _ = x.shape
        start = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(1, B, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k, v = self._kv(x)
        q, k = self.rope(q, offset=start), self.rope(k, offset=start)
        ctx_k, ctx_v = cache.keys_and_values()
        out = block_attention(q, k, v, ctx_k, ctx_v, scale=1.0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))


class Gemma4MLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Gemma4DraftLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4DraftAttention(config)
        self.mlp = Gemma4MLP(config)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar
