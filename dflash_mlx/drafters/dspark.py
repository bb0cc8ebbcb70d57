"""The DSpark drafter family (DeepSeek DeepSpec): a DFlash-style block drafter whose slot i also looks at draft i-1.

The backbone is the DFlash one (`drafters.dflash.DraftLayer`: Qwen3 layers attending from the block to the fused target
features of every committed token and to the block itself, bidirectionally), with the drafter's own embedding and
LM head. On top of the parallel logits of each slot sits the sequential Markov head: slot i's logits get
`markov_w2(markov_w1[token at slot i-1])` added (the anchor for slot 0), so the proposal is drawn slot by slot.
That is a `DraftWalk` (`acceptance.py`): the engine's acceptor draws each slot from its row, which keeps greedy
output and sampling exact. An optional confidence head estimates, per slot, the probability that the draft
survives verification given the prefix before it (`DSparkWalk.confidence`).

Variants: NVIDIA's Nemotron head (DFlash lineage) runs the block causally over a window of the context with a
learned per-head attention sink (`SinkDraftAttention`) and projects with the target's LM head; a Gemma-4 backbone
swaps the layers for `dspark_layers.Gemma4DraftLayer` and scales its embedding by sqrt(hidden).

Configuration and packagings: `dspark_config.py`. Reference: DeepSpec's inference path as mlx-dspark ports it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import DFlashError
from .dflash import DFlashDrafter, DraftAttention
from .dspark_config import DSparkConfig, is_dspark
from .dspark_layers import Gemma4DraftLayer
from .families import DrafterFamily


class SinkDraftAttention(DraftAttention):
    """The draft attention of a head with an attention sink (NVIDIA's Nemotron DSpark head): a learned logit per
    query head joins every row's softmax denominator (a key with no value), as SDPA's `sinks` takes it."""

    def __init__(self, config: DSparkConfig, sliding: bool):
        super().__init__(config, sliding)
        self.attention_sink_bias = mx.zeros((config.num_attention_heads,))

    def sinks(self, dtype: mx.Dtype) -> mx.array:
        return self.attention_sink_bias.astype(dtype)


class MarkovHead(nn.Module):
    """`markov_w2(markov_w1[prev])`: a rank-r bias on the next slot's logits from the previous token (a target
    id, also on a reduced-vocabulary head; the bias is over the drafter's own vocabulary)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.out_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkWalk:
    """One block's draft, slot by slot (the `acceptance.DraftWalk` protocol).

    `row(i, prev)`: logits [V] over the target vocabulary for draft i given `prev` (the anchor for i = 0, else
    draft i-1): the slot's parallel logits plus the Markov bias of `prev`; ids outside a reduced draft
    vocabulary get -1e9. Rows must be asked in order 0, 1, ..., as the acceptor does.

    `confidence()`: after all `length` rows were drawn, a lazy array [length] of the confidence head's
    probability (sigmoid) for each slot, computed with the predecessors the rows were drawn with. Slot i's value
    is the head's estimate that draft i survives verification given that drafts 0..i-1 did (a conditional; the
    chance that the whole prefix 0..i survives is the cumulative product). `has_confidence` says whether the
    checkpoint has the head; without it `confidence()` is None.
    """

    def __init__(self, drafter: "DSparkDrafter", hidden: mx.array, base: mx.array):
        self.drafter, self.hidden, self.base = drafter, hidden, base  # hidden [n, H], base [n, V_draft]
        self.length = base.shape[0]
        self.prevs: List[mx.array] = []
        self.has_confidence = "confidence_head" in drafter

    def draft_row(self, i: int, prev: mx.array) -> mx.array:
        """Row i over the drafter's own vocabulary (reduced or not)."""
        if i != len(self.prevs):
            raise DFlashError(f"DSpark draft rows must be drawn in order; asked for slot {i} after {len(self.prevs)}")
        self.prevs.append(mx.array(prev, dtype=mx.int32).reshape(()))
        return self.base[i] + self.drafter.markov_bias(self.prevs[-1])

    def row(self, i: int, prev: mx.array) -> mx.array:
        return self.drafter.to_target_vocab(self.draft_row(i, prev))

    def confidence(self) -> Optional[mx.array]:
        if not self.has_confidence:
            return None
        if len(self.prevs) != self.length:
            raise DFlashError(f"confidence() needs all {self.length} draft rows drawn first ({len(self.prevs)} were)")
        return self.drafter.confidence(self.hidden, mx.stack(self.prevs))


class DSparkDrafter(DFlashDrafter):
    """DSpark drafter. Bind it (`bind`) only when it borrows the target's embedding or head (see the config)."""

    tree_logits = None  # its slots' logits depend on the previous draft (the Markov head): no draft trees

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        H = config.hidden_size
        if config.backbone == "gemma4":
            self.layers = [Gemma4DraftLayer(config) for _ in range(config.num_hidden_layers)]
        elif config.backbone != "qwen3":
            raise DFlashError(f"DSpark drafter config has backbone {config.backbone!r}; it must be 'qwen3' or "
                              "'gemma4' (convert the drafter again)")
        if config.attention_sink:
            for layer, kind in zip(self.layers, config.layer_types):
                layer.self_attn = SinkDraftAttention(config, kind == "sliding_attention")
        if config.rope_traditional:
            for layer in self.layers:
                layer.self_attn.rope = initialize_rope(config.head_dim, config.rope_theta, True,
                                                       config.rope_scaling, config.max_position_embeddings)
        if config.has_own_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
        if config.has_own_lm_head or config.draft_vocab_size:
            self.lm_head = nn.Linear(H, config.out_vocab_size, bias=False)
        if config.markov_rank:
            self.markov_head = MarkovHead(config)
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (config.markov_rank if config.confidence_head_with_markov
                                                       else 0))

    @property
    def max_drafts(self) -> int:
        return self.config.max_drafts

    @property
    def causal_block(self) -> bool:
        return all(layer.self_attn.block_causal for layer in self.layers)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    # -- the parallel part: one backbone pass over the full trained block ------------------------------------
    def slot_hidden(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Final-normed hidden states [n, H] of the n = width-1 predicting slots, for `block_ids` [1, width] =
        [anchor, MASK x (width-1)]. The block run is the trained one ([anchor, MASK x (dspark_block-1)]), at the
        positions right after the cached context; the cache is unchanged. A causal block (Nemotron) stops after
        the last slot read: the slots after it cannot change the ones before."""
        cfg = self.config
        n = block_ids.shape[1] - 1
        if not 1 <= n <= cfg.max_drafts:
            raise DFlashError(f"DSpark drafter proposes 1..{cfg.max_drafts} tokens per block; verify width "
                              f"{n + 1} asks for {n} (use a width of at most {cfg.block_size})")
        run = cfg.logits_start + n if self.causal_block else cfg.dspark_block
        ids = mx.concatenate([block_ids[:, :1].astype(mx.int32),
                              mx.full((1, run - 1), cfg.mask_token_id, dtype=mx.int32)], axis=1)
        if "embed_tokens" in self:
            x = self.embed_tokens(ids)
            if cfg.backbone == "gemma4":
                x = x * cfg.hidden_size ** 0.5  # Gemma's embedding scale (a borrowed target embedding has it)
        else:
            if self.binding is None:
                raise RuntimeError("this DSpark drafter borrows the target's embedding; call drafter.bind(...)")
            x = self.binding.embed(ids)
        for layer, c in zip(self.layers, cache):
            x = layer(x, c)
        s = cfg.logits_start
        return self.norm(x[0, s : s + n])

    def draft_logits(self, h: mx.array) -> mx.array:
        """Parallel logits over the drafter's vocabulary (own head, or the target's), soft-capped if configured."""
        if "lm_head" in self:
            logits = self.lm_head(h)
        elif self.binding is not None:
            logits = self.binding.head(h)
        else:
            raise RuntimeError("this DSpark drafter borrows the target's LM head; call drafter.bind(...)")
        cap = self.config.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    # -- the sequential part ----------------------------------------------------------------------------------
    def markov_bias(self, prev: mx.array) -> mx.array:
        """Bias [V_draft] the Markov head adds to the slot after target token `prev` (0 without the head)."""
        if "markov_head" not in self:
            return mx.zeros((), dtype=mx.float32)
        m = self.markov_head
        return m.markov_w2(m.markov_w1(prev))

    def confidence(self, hidden: mx.array, prevs: mx.array) -> mx.array:
        """sigmoid(confidence_head([hidden ; markov_w1[prev]])) per slot: [n]."""
        feats = hidden
        if self.config.confidence_head_with_markov:
            feats = mx.concatenate([hidden, self.markov_head.markov_w1(prevs).astype(hidden.dtype)], axis=-1)
        return mx.sigmoid(self.confidence_head.proj(feats)[..., 0])

    def to_target_vocab(self, logits: mx.array) -> mx.array:
        return super().to_target_vocab(logits) if self.config.draft_vocab_size else logits

    def to_target_id(self, ids: mx.array) -> mx.array:
        ids = ids.astype(mx.int32)
        return ids + self.d2t[ids] if self.config.draft_vocab_size else ids

    @property
    def has_confidence(self) -> bool:
        """Whether the checkpoint has the confidence head (the engine then lets the width policy cut blocks)."""
        return "confidence_head" in self

    def draft_walk(self, block_ids: mx.array, cache: List[KVCache]) -> DSparkWalk:
        """The block's proposal as a walk (what the engine's acceptors draw from)."""
        h = self.slot_hidden(block_ids, cache)
        return DSparkWalk(self, h, self.draft_logits(h))

    def greedy_draft(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Target ids [1, width-1]: each slot's argmax given the previous slot's (the anchor for slot 0)."""
        walk = self.draft_walk(block_ids, cache)
        prev, out = block_ids[0, 0].astype(mx.int32), []
        for i in range(walk.length):
            prev = self.to_target_id(mx.argmax(walk.draft_row(i, prev), axis=-1))
            out.append(prev)
        return mx.stack(out)[None]

    def __call__(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Logits [1, width-1, V] of the greedy walk: row i is slot i's proposal given the previous slot's argmax.

        These are not the parallel logits (those lack the Markov term and are not what any draft is drawn from);
        a sampling acceptor must use `draft_walk`, which draws each row given the previous slot's sampled token."""
        walk = self.draft_walk(block_ids, cache)
        prev, rows = block_ids[0, 0].astype(mx.int32), []
        for i in range(walk.length):
            row = walk.draft_row(i, prev)
            rows.append(self.to_target_vocab(row))
            prev = self.to_target_id(mx.argmax(row, axis=-1))
        return mx.stack(rows)[None]


def rename(weights: Dict[str, mx.array], config: DSparkConfig) -> Dict[str, mx.array]:
    """Checkpoint tensors -> parameter names. Every packaging already uses DeepSpec's names; the index tables
    differ: `d2t` (draft -> target offsets) becomes int32, `t2d` (only training needs it) is dropped. A checkpoint
    without `embed_tokens`/`lm_head` borrows the target's (the config is told so before the drafter is built)."""
    out = {k: v for k, v in weights.items() if k != "t2d"}
    if "d2t" in out:
        if not config.draft_vocab_size:
            raise DFlashError("DSpark drafter checkpoint has a d2t table but config.json declares no reduced "
                              "draft_vocab_size; restore config.json from the drafter's source")
        out["d2t"] = out["d2t"].astype(mx.int32)
    elif config.draft_vocab_size:
        raise DFlashError(f"DSpark drafter config.json declares draft_vocab_size {config.draft_vocab_size} but the "
                          "checkpoint has no d2t table to map draft ids to target ids; re-download the drafter")
    config.has_own_embed = "embed_tokens.weight" in out or "embed_tokens.scales" in out
    config.has_own_lm_head = "lm_head.weight" in out or "lm_head.scales" in out
    return out


FAMILY = DrafterFamily("DSpark", is_dspark, DSparkConfig, DSparkDrafter,
                       keep_float=("markov_head", "confidence_head"), rename=rename)
