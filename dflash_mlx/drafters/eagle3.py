"""The EAGLE-3 drafter: one Llama decoder layer over the target's fused taps, drafting a chain token by token.

At position t it reads the target's hidden states at three tapped layers (low, middle, high) for token t, fused by
`fc` (3H -> H), and the embedding of token t+1, and predicts token t+2:

    e = input_layernorm(embed(tok_{t+1}))      h = hidden_norm(x_t)       x_t = fc([taps_t])
    g = x_t + attention([e; h])                the q/k/v projections read 2H; the residual is x_t (or h)
    g = g + mlp(post_attention_layernorm(g))   g_t: the layer's pre-norm output
    logits = lm_head(norm(g_t))                a reduced draft vocabulary, id i is target id i + d2t[i]

Each further draft feeds g back in place of the target's fused state, with the draft just chosen as the token. The
embedding is the target's (published checkpoints carry a frozen copy of it); the head is the drafter's own unless
its config ties it to the target's over the whole vocabulary.

The draft cache (`make_cache`) is the layer's KV cache followed by one `PairQueue` (the MTP drafter's): fused rows
of committed positions whose next token is not known yet, and tokens waiting for their row. Row i pairs with token
i+1, so the prefill only appends rows (`append_context`) and the proposer appends tokens (`add_tokens`); pairs run
through the layer as soon as both halves are known (`run_ready`), and the newest output is the seed of the next
chain. A draft tree runs its nodes as a batch of one-row sequences that see the cache and their ancestors
(`tree_step`); nothing of it is written to the cache. Drafting: `decode.proposers.eagle3`. Config: `eagle3_config`.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import DFlashError
from .eagle3_config import Eagle3Config, is_eagle3
from .families import DrafterFamily
from .mtp_block import MTPPending as PairQueue

EAGLE3 = "eagle3"


class TreeKV:
    """Keys and values of a tree's expanded nodes for one layer: [1, kv heads, nodes, head_dim] each."""

    def __init__(self):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def add(self, k: mx.array, v: mx.array) -> None:
        # k, v: [n, kv, 1, hd] for n nodes -> appended as n more key positions
        k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config, input_size: int):
        super().__init__()
        hd, bias = config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(input_size, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(input_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(input_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, config.hidden_size, bias=bias)
        self.scale = hd ** -0.5
        self.rope = initialize_rope(hd, config.rope_theta, False, config.rope_scaling,
                                    config.max_position_embeddings)

    def _heads(self, x: mx.array, proj, heads: int) -> mx.array:
        B, L, _ = x.shape
        return proj(x).reshape(B, L, heads, -1).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, cache: KVCache, tree=None) -> mx.array:
        """x [1, L, in] at the cache's next L positions (written to it, causal); or, with `tree` = (TreeKV,
        ancestor mask [n, m], depth), x [n, 1, in]: n nodes at position offset + depth, each seeing the cache, its
        ancestors among the tree's m expanded nodes and itself (nothing written to the cache)."""
        q = self._heads(x, self.q_proj, self.n_heads)
        k = self._heads(x, self.k_proj, self.n_kv_heads)
        v = self._heads(x, self.v_proj, self.n_kv_heads)
        B, L = x.shape[:2]
        if tree is None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            keys, values = cache.update_and_fetch(k, v)
            mask = create_attention_mask(x, cache)
            out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=self.scale, mask=mask)
        else:
            kv, ancestors, depth = tree
            at = cache.offset + depth
            q, k = self.rope(q, offset=at), self.rope(k, offset=at)
            parts_k, parts_v, seen = [], [], []
            if cache.offset:
                ck, cv = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
                parts_k.append(mx.broadcast_to(ck, (B,) + ck.shape[1:]))
                parts_v.append(mx.broadcast_to(cv, (B,) + cv.shape[1:]))
                seen.append(mx.ones((B, cache.offset), dtype=mx.bool_))
            if kv.keys is not None:
                parts_k.append(mx.broadcast_to(kv.keys, (B,) + kv.keys.shape[1:]))
                parts_v.append(mx.broadcast_to(kv.values, (B,) + kv.values.shape[1:]))
                seen.append(ancestors)
            parts_k.append(k)
            parts_v.append(v)
            seen.append(mx.ones((B, 1), dtype=mx.bool_))
            mask = mx.concatenate(seen, axis=1)[:, None, None, :]
            out = mx.fast.scaled_dot_product_attention(q, mx.concatenate(parts_k, axis=2),
                                                       mx.concatenate(parts_v, axis=2), scale=self.scale,
                                                       mask=mask)
            kv.add(k, v)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, I, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class FirstLayer(nn.Module):
    """The EAGLE-3 layer: attention reads [input_layernorm(embedding); hidden_norm(hidden)]."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(config, 2 * H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(config)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: KVCache, tree=None) -> mx.array:
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = residual + self.self_attn(mx.concatenate([self.input_layernorm(embeds), h], axis=-1), cache, tree)
        return x + self.mlp(self.post_attention_layernorm(x))


class Layer(nn.Module):
    """A plain Llama decoder layer, for checkpoints with more than one."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(config, H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array, cache: KVCache, tree=None) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cache, tree)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 with the Drafter shape the engine expects; its drafts come from `decode.proposers.eagle3`
    (`drafts_with` names that proposer). Call `bind` (a `TargetBinding`) before drafting."""

    drafts_with = EAGLE3

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H, eps = config.hidden_size, config.rms_norm_eps
        taps = config.num_taps * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(taps, eps=eps)
        self.fc = nn.Linear(taps, H, bias=False)
        self.layers = [FirstLayer(config)] + [Layer(config) for _ in range(config.num_hidden_layers - 1)]
        self.norm = nn.RMSNorm(H, eps=eps)
        if config.has_own_lm_head:
            self.lm_head = nn.Linear(H, config.own_vocab, bias=False)
        if config.draft_vocab_size:
            self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
        if config.has_own_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.binding = None
        self.weights_form = "as stored"

    # -- the Drafter shape ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> Optional[int]:
        return None

    def bind(self, binding) -> "Eagle3Drafter":
        self.binding = binding
        return self

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers] + [PairQueue()]

    def tree_cache(self) -> List[TreeKV]:
        """Empty per-layer keys and values for the nodes of one draft tree (`tree_step`)."""
        return [TreeKV() for _ in self.layers]

    def rollback(self, cache: List[Any], num_tokens: int) -> None:
        """Drop the newest `num_tokens` positions of the layers' caches."""
        if num_tokens > 0:
            for c in cache[:-1]:
                c.trim(num_tokens)

    def append_context(self, target_hidden: mx.array, cache: List[Any]) -> None:
        """Tapped features [1, S, n*H] of newly processed target positions (the prefill): fused and queued; the
        pairs whose token is known run now (the proposer observes the prompt before the prefill)."""
        self.add_rows(cache, target_hidden)
        self.run_ready(cache)

    # -- the pair queue ------------------------------------------------------------------------------------------
    def add_rows(self, cache: List[Any], target_hidden: mx.array) -> None:
        """Tapped features [1, S, n*H] waiting for their tokens, fused now (lazily); nothing runs."""
        queue = cache[-1]
        rows = self.fuse(target_hidden)
        queue.hidden = rows if queue.hidden is None else mx.concatenate([queue.hidden, rows], axis=1)

    def add_tokens(self, cache: List[Any], tokens) -> None:
        """Tokens the target committed (or was prompted with), in order: each is the partner of one row."""
        queue = cache[-1]
        tokens = [int(t) for t in tokens]
        drop = min(queue.skip, len(tokens))
        queue.skip -= drop
        queue.tokens.extend(tokens[drop:])

    def run_ready(self, cache: List[Any]) -> None:
        """Run every (row, token) pair whose token is known; the newest output becomes the seed."""
        queue = cache[-1]
        n = min(queue.rows, len(queue.tokens))
        if n == 0:
            return
        out = self.forward(mx.array([queue.tokens[:n]], dtype=mx.int32), queue.hidden[:, :n], cache)
        queue.seed = out[:, -1:]
        queue.hidden = queue.hidden[:, n:] if queue.rows > n else None
        queue.tokens = queue.tokens[n:]

    def drop_newest(self, cache: List[Any], n: int) -> None:
        """Take back the newest `n` rows and tokens (not run yet): an observed pass undone."""
        queue = cache[-1]
        queue.hidden = queue.hidden[:, :-n] if queue.rows > n else None
        queue.tokens = queue.tokens[:-n] if n else queue.tokens

    # -- the model -----------------------------------------------------------------------------------------------
    def fuse(self, target_hidden: mx.array) -> mx.array:
        """Tapped features [..., n*H] -> the layer's width [..., H]."""
        if "input_norm" in self:
            target_hidden = self.input_norm(target_hidden)
        return self.fc(target_hidden)

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self:
            return self.embed_tokens(tokens)
        if self.binding is None:
            raise RuntimeError("EAGLE-3 drafter is not bound to a target; call drafter.bind(...) first")
        return self.binding.embed(tokens)

    def forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> mx.array:
        """Pre-norm outputs g [1, T, H] for tokens [1, T] paired with fused states [1, T, H], appended to the
        cache at its next T positions."""
        x = self.layers[0](self.embed(tokens), hidden, cache[0])
        for layer, c in zip(self.layers[1:], cache[1:]):
            x = layer(x, c)
        return x

    def tree_step(self, tokens: mx.array, hidden: mx.array, cache: List[Any], kvs: List[TreeKV],
                  ancestors: mx.array, depth: int) -> mx.array:
        """Outputs g [n, 1, H] of n tree nodes (tokens [n], their parents' outputs [n, 1, H]) one position past
        the cache's `depth - 1`-th; `ancestors` [n, m] marks which of the m nodes expanded before each one sees."""
        tree = lambda i: (kvs[i], ancestors, depth)  # noqa: E731
        x = self.layers[0](self.embed(tokens.reshape(-1, 1)), hidden, cache[0], tree(0))
        for i, (layer, c) in enumerate(zip(self.layers[1:], cache[1:]), start=1):
            x = layer(x, c, tree(i))
        return x

    def draft_logits(self, g: mx.array) -> mx.array:
        """Logits over the drafter's own vocabulary for pre-norm outputs g."""
        h = self.norm(g)
        if "lm_head" in self:
            return self.lm_head(h)
        logits = self.binding.head(h)
        cap = getattr(self.binding, "softcap", None)
        return mx.tanh(logits / cap) * cap if cap else logits

    def logits(self, g: mx.array) -> mx.array:
        """Logits over the target's vocabulary: a reduced head's scattered into place, every other id -1e9."""
        logits = self.draft_logits(g)
        if "d2t" not in self:
            return logits
        ids = mx.arange(logits.shape[-1], dtype=mx.int32) + self.d2t
        full = mx.full((*logits.shape[:-1], self.config.vocab_size), -1e9, dtype=logits.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(ids, logits.shape), logits, axis=-1)


# -- checkpoints -----------------------------------------------------------------------------------------------
def rename(weights, config: Eagle3Config):
    """Checkpoint tensors -> parameter names, for both layouts: SpecForge's `midlayer.*` is `layers.0.*`; `t2d`
    (only training needs it) is dropped and `d2t` becomes int32. The embedding is a frozen copy of the target's:
    it is kept only where the target's cannot serve (a drafter narrower than its target). The config learns here
    whether the checkpoint has its own head."""
    out = {}
    for key, value in weights.items():
        if key == "t2d" or key.startswith("verifier_"):
            continue
        if key.startswith("input_norm.") and not config.norm_before_fc:
            continue  # a norm the config does not apply (the reference drops it too)
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer."):]
        out[key] = value
    if "d2t" in out:
        if config.draft_vocab_size:
            out["d2t"] = out["d2t"].astype(mx.int32)
        elif mx.any(out["d2t"] != 0).item():
            raise DFlashError("EAGLE-3 drafter checkpoint maps its whole vocabulary through a non-trivial d2t "
                              "table; such a head is not supported")
        else:
            del out["d2t"]
    elif config.draft_vocab_size:
        raise DFlashError(f"EAGLE-3 drafter config.json declares draft_vocab_size {config.draft_vocab_size} but "
                          "the checkpoint has no d2t table to map draft ids to target ids; re-download the drafter")
    config.has_own_lm_head = "lm_head.weight" in out or "lm_head.scales" in out
    if not config.has_own_lm_head and config.draft_vocab_size:
        raise DFlashError("EAGLE-3 drafter checkpoint has a reduced vocabulary but no lm_head; re-download it")
    embed = [k for k in out if k.startswith("embed_tokens.")]
    config.has_own_embed = bool(embed) and config.hidden_size != config.target_hidden_size
    if not config.has_own_embed:
        if config.hidden_size != config.target_hidden_size:
            raise DFlashError(f"EAGLE-3 drafter is {config.hidden_size} wide for a {config.target_hidden_size}-wide "
                              "target but ships no embedding of its own; re-download the drafter")
        for k in embed:
            del out[k]
    return out


FAMILY = DrafterFamily("EAGLE-3", is_eagle3, Eagle3Config, Eagle3Drafter, rename=rename,
                       marks=("midlayer.", "layers.0.hidden_norm."))
