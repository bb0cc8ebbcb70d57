"""The target's own multi-token-prediction (MTP) block as a drafter: `MTPDrafter`, the shape both checkpoint layouts
load into (the Qwen layout in `mtp`, the DeepSeek-V3 one in `mtp_deepseek`).

The MTP at position t reads the target's final-normed hidden state h_t and the embedding of token t+1, and
predicts token t+2:

    x = fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
    x = layers(x)            mtp_num_hidden_layers full-attention decoder layers (mlx-lm's own layer classes)
    m_t = norm(x)            logits = target head(m_t); m_t also stands in for h_{t+1} in the next step

The embedding and LM head are the target's (borrowed through `bind`); the layers keep their own KV cache, one
entry per position. The tap is the target's last decoder layer (pre-norm); the drafter applies the target's own
final norm, as the MTP was trained on (and the reference feeds) the normed hidden state.

The draft cache (`make_cache`) is the layers' KV caches followed by one `MTPPending`: target hidden rows whose
next token is not known yet, and tokens waiting for their row. Row i of the target's hidden stream pairs with
token i+1 of the token stream, so the prefill only appends rows (`append_context`) and the proposer appends tokens
(`add_tokens`); pairs run through the MTP as soon as both halves are known (`run_ready`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache


@dataclass
class MTPConfig:
    """What the engine reads of a drafter's config, for the MTP block of a target with `num_target_layers`."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int = 1  # MTP layers
    block_size: int = 3  # widest pass: block_size - 1 drafts (the reference's default: depth + 2)
    mask_token_id: Optional[int] = None  # the MTP drafts autoregressively: no mask token
    needs_mask = False  # (class attribute) what the pairing check reads
    target_layer_ids: List[int] = field(default_factory=list)

    def __post_init__(self):
        self.target_layer_ids = [self.num_target_layers - 1]  # the last decoder layer (the drafter norms it)


@dataclass
class MTPPending:
    """The MTP's carry-over inside the draft cache (see the module docstring). `skip` tokens at the start of the
    token stream have no row (the very first prompt token); `seed` is the MTP output of the newest pair run."""

    hidden: Optional[mx.array] = None  # [1, P, H] target hidden rows (last layer, pre-norm) without their token
    tokens: List[int] = field(default_factory=list)
    skip: int = 1
    seed: Optional[mx.array] = None  # [1, 1, H]

    @property
    def rows(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.shape[1])

    @property
    def state(self) -> List[mx.array]:
        return [a for a in (self.hidden, self.seed) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def copy(self) -> "MTPPending":
        return MTPPending(self.hidden, list(self.tokens), self.skip, self.seed)  # arrays are never written in place

    def is_trimmable(self) -> bool:
        return False  # a prefix snapshot of it cannot be cut shorter

    def empty(self) -> bool:
        return self.hidden is None and not self.tokens and self.seed is None


class _Borrowed:
    """The target's embedding, LM head and final norm (a plain object, so none of it becomes our parameter)."""

    def __init__(self, embed=None, head=None, norm=None):
        self.embed, self.head, self.norm = embed, head, norm


class MTPDrafter(nn.Module):
    """The MTP block with the Drafter shape the engine expects; its drafts come from `decode.proposers.mtp`
    (`drafts_with` names that proposer)."""

    drafts_with = "mtp"

    def __init__(self, config: MTPConfig, layer_class, layer_args):
        super().__init__()
        self.config = config
        H, eps = config.hidden_size, layer_args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [layer_class(layer_args, 0) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.target = _Borrowed()
        self.binding = None
        self.weights_form = "as stored"

    # -- the Drafter shape ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> Optional[int]:
        return None

    def bind(self, binding) -> "MTPDrafter":
        """Borrow the target's embedding and head (a `TargetBinding`); the final norm from its source target."""
        self.binding = binding
        norm = getattr(getattr(getattr(binding, "source", None), "inner", None), "norm", None)
        self.target = _Borrowed(binding.embed, binding.head, self.target.norm if norm is None else norm)
        return self

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers] + [MTPPending()]

    def append_context(self, target_hidden: mx.array, cache: List[Any]) -> None:
        """Hidden rows [1, S, H] of newly processed target positions (the prefill); the pairs whose token is known
        run now, chunk by chunk (the proposer observes the prompt before the prefill)."""
        self.add_rows(cache, target_hidden)
        self.run_ready(cache)

    def add_rows(self, cache: List[Any], target_hidden: mx.array) -> None:
        """Hidden rows [1, S, H] (the tapped last layer, pre-norm) waiting for their tokens; nothing runs."""
        pending = cache[-1]
        pending.hidden = target_hidden if pending.hidden is None else mx.concatenate(
            [pending.hidden, target_hidden], axis=1)

    def add_tokens(self, cache: List[Any], tokens) -> None:
        """Tokens the target committed (or was prompted with), in order: each is the partner of one row."""
        pending = cache[-1]
        tokens = [int(t) for t in tokens]
        drop = min(pending.skip, len(tokens))
        pending.skip -= drop
        pending.tokens.extend(tokens[drop:])

    def rollback(self, cache: List[Any], num_tokens: int) -> None:
        """Drop the newest `num_tokens` MTP positions."""
        if num_tokens > 0:
            for c in cache[:-1]:
                c.trim(num_tokens)

    # -- the MTP itself ----------------------------------------------------------------------------------------
    def forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> mx.array:
        """MTP outputs [1, T, H] for token ids [1, T] paired with hidden states [1, T, H] (already final-normed),
        appended to the cache at its next T positions."""
        e = self.target.embed(tokens)
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0]) if self.layers else None
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)

    def logits(self, m: mx.array) -> mx.array:
        return self.target.head(m)

    def run_ready(self, cache: List[Any]) -> None:
        """Run every (row, token) pair whose token is known; the newest output becomes the seed."""
        pending = cache[-1]
        n = min(pending.rows, len(pending.tokens))
        if n == 0:
            return
        if self.target.embed is None or self.target.norm is None:
            raise RuntimeError("MTP drafter is not bound to a target; call drafter.bind(...) first")
        rows = pending.hidden[:, :n]
        ids = mx.array([pending.tokens[:n]], dtype=mx.int32)
        out = self.forward(ids, self.target.norm(rows), cache)
        pending.seed = out[:, -1:]
        pending.hidden = pending.hidden[:, n:] if pending.rows > n else None
        pending.tokens = pending.tokens[n:]

    def drop_newest(self, cache: List[Any], n: int) -> None:
        """Take back the newest `n` rows and tokens (not run yet): an observed pass undone."""
        pending = cache[-1]
        pending.hidden = pending.hidden[:, :-n] if pending.rows > n else None
        pending.tokens = pending.tokens[:-n] if n else pending.tokens

    def drop_pairs(self, cache: List[Any], n: int) -> None:
        """Forget the oldest `n` waiting (row, token) pairs: the MTP already holds entries for their positions."""
        pending = cache[-1]
        pending.hidden = pending.hidden[:, n:] if pending.rows > n else None
        pending.tokens = pending.tokens[n:]
