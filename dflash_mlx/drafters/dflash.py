"""The DFlash drafter: a few Qwen3 blocks that denoise a whole block of masked tokens in one forward pass.

Each draft layer attends from the block to (a) the fused features of every committed token, kept in a KV cache
that is only ever appended to, and (b) the block itself, bidirectionally. The drafter owns no embedding and no LM
head: it borrows the target's (see `bind`), unless its config has a reduced `draft_vocab_size`, whose head it owns
(its logits are scattered back to target ids; `greedy_draft` maps only the argmax ids instead).
Math: docs/algorithm.md.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from ..metal.block_attention import block_attention
from .config import DFlashConfig


def _qwen3_args(config: DFlashConfig) -> qwen3.ModelArgs:
    return qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        vocab_size=config.vocab_size,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        head_dim=config.head_dim,
        tie_word_embeddings=False,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
    )


class DraftAttention(qwen3.Attention):
    """Qwen3 attention whose keys and values cover the cached context, the new context and the block."""

    def __init__(self, config: DFlashConfig, sliding: bool):
        super().__init__(_qwen3_args(config))
        self.sliding_window = config.sliding_window if sliding else None
        # As in the reference: sliding layers are causal inside the block unless `is_causal` says otherwise,
        # and an explicit `is_causal` applies to every layer.
        self.block_causal = sliding if config.is_causal is None else bool(config.is_causal)

    def append_context(self, ctx: mx.array, cache: KVCache) -> None:
        """Store K/V of newly committed context features [1, S, H] at their absolute positions."""
        S = ctx.shape[1]
        k = self.k_norm(self.k_proj(ctx).reshape(1, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(ctx).reshape(1, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        cache.update_and_fetch(self.rope(k, offset=cache.offset), v)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        # x: [1, B, H] normed block at positions start..start+B-1, where start = cache.offset.
        _, B, _ = x.shape
        start = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(1, B, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(1, B, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(1, B, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=start), self.rope(k, offset=start)
        ctx_k, ctx_v = cache.keys_and_values()
        # Context keys in a sliding window, block keys all or causal: see dflash_mlx.metal.block_attention.
        out = block_attention(q, k, v, ctx_k, ctx_v, scale=self.scale, window=self.sliding_window,
                              causal=self.block_causal, sinks=self.sinks(q.dtype))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))

    def sinks(self, dtype: mx.Dtype) -> Optional[mx.array]:
        """Per-head attention-sink logits joining every softmax denominator (none in DFlash heads)."""
        return None


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, sliding: bool):
        super().__init__()
        self.self_attn = DraftAttention(config, sliding)
        self.mlp = qwen3.MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetBinding:
    """The target's embedding and LM head, as the drafter borrows them (plain object: not a submodule)."""

    def __init__(self, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array],
                 softcap: Optional[float] = None, source: Any = None):
        self.embed = embed
        self.head = head  # without the target's logit soft-cap: the drafter applies a cap after its multiplier
        self.softcap = softcap  # the target's final logit soft-cap, used when the drafter config has none
        self.source = source  # the target these were borrowed from, so binding it again can be skipped


class DFlashDrafter(nn.Module):
    """Block-diffusion drafter. Call `bind(target)` before drafting."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        if config.attention_bias:
            raise DFlashError("drafters with attention_bias=true are not supported")
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_taps * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DraftLayer(config, t == "sliding_attention") for t in config.layer_types]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        if config.draft_vocab_size:
            # A reduced draft vocabulary with its own head; draft id i is target id i + d2t[i] (speculators).
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
        self.binding: Optional[TargetBinding] = None
        # How the weights are held, for `--verbose` (`drafters.io.load_drafter` says when it changed them).
        self.weights_form = "as stored"

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> Optional[int]:
        return self.config.mask_token_id

    def bind(self, binding: TargetBinding) -> "DFlashDrafter":
        self.binding = binding
        return self

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def rollback(self, cache: List[KVCache], num_tokens: int) -> None:
        """Drop the newest `num_tokens` context positions from every layer's cache (mirrors the target's)."""
        for c in cache:
            c.trim(num_tokens)

    def append_context(self, target_hidden: mx.array, cache: List[KVCache]) -> None:
        """Fuse tapped target features [1, S, n*H] of newly committed tokens and add them to every layer's cache.

        The fusion `hidden_norm(fc(.))` runs once and is shared by all draft layers.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.append_context(ctx, c)

    def __call__(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Logits [1, B-1, V] for block slots 1..B-1.

        block_ids: [1, B] = [last committed token, MASK x (B-1)]; the block sits right after the committed
        context held in `cache` (positions offset..offset+B-1). Block K/V are transient: the cache is unchanged.
        """
        return self.to_target_vocab(self.draft_logits(self.hidden_states(block_ids, cache)))

    def greedy_draft(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Target ids [1, B-1] of the most likely token per slot: the argmax of `__call__`, found over the
        drafter's own vocabulary and then mapped, so the full-vocabulary logits are never built."""
        ids = mx.argmax(self.draft_logits(self.hidden_states(block_ids, cache)), axis=-1).astype(mx.int32)
        return ids + self.d2t[ids] if "lm_head" in self else ids

    def tree_logits(self, block_ids: mx.array, cache: List[KVCache]) -> Tuple[mx.array, Optional[mx.array]]:
        """What a draft tree ranks, without the full-vocabulary scatter of `__call__`: logits [1, B-1, N] over the
        drafter's own vocabulary, and the target id of each column (None: the columns are the target's ids)."""
        logits = self.draft_logits(self.hidden_states(block_ids, cache))
        if "lm_head" not in self:
            return logits, None
        return logits, mx.arange(logits.shape[-1], dtype=mx.int32) + self.d2t

    def hidden_states(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Final-normed hidden states [1, B-1, H] of block slots 1..B-1 (arguments as in `__call__`)."""
        if self.binding is None:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(...) first")
        cfg = self.config
        x = self.binding.embed(block_ids)
        if cfg.input_embedding_scale is not None:
            x = x * cfg.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            x = layer(x, c)
        return self.norm(x[:, 1:])

    def draft_logits(self, h: mx.array) -> mx.array:
        """Logits of final-normed hidden states over the drafter's vocabulary (the target's unless reduced)."""
        cfg = self.config
        logits = self.lm_head(h) if "lm_head" in self else self.binding.head(h)
        if cfg.output_multiplier is not None:
            logits = logits * cfg.output_multiplier
        cap = cfg.final_logit_softcapping if cfg.final_logit_softcapping is not None else self.binding.softcap
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def to_target_vocab(self, logits: mx.array) -> mx.array:
        """Scatter reduced-vocabulary logits [..., N] into the target's [..., V]; other ids get -1e9 (never drafted)."""
        if "lm_head" not in self:
            return logits
        ids = mx.arange(logits.shape[-1], dtype=mx.int32) + self.d2t
        full = mx.full((*logits.shape[:-1], self.config.vocab_size), -1e9, dtype=logits.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(ids, logits.shape), logits, axis=-1)
