"""The DFlash 2 drafter family: DFlash plus dynamic convolutions and a candidate selector (z-lab / Inco AI).

DFlash 2 keeps DFlash's backbone (tapped target features injected as context K/V, one pass per block, the target's
embedding and head borrowed) and adds two small trained parts, as z-lab's `dflash` package defines them
(model.py / model_mlx.py, `DFlash2DraftModel`):

- around each attention and MLP sublayer a grouped dynamic causal convolution over the block rows (`prepare`
  before the sublayer, `finish` after it); its taps are a learned `base_kernel` plus a per-row correction
  `kernel_projection(normed input)` shared by each group of `conv_group_size` channels. Row 0 (the anchor) has no
  predecessor: the shifted rows are zero-padded, never taken from the context;
- a candidate selector: the top `selector_top_k` target-head logits of each draft slot (after the drafter's
  multiplier and soft-cap) are rescored with `unary + <P[prev] * hidden_projection(h), S[candidate]>`, P and S
  being predecessor/successor codebooks, and the draft is walked slot by slot from the verified anchor.

The walk is what the engine drives (`draft_walk`): row i is the selector's scores scattered into a vocabulary
row (-inf outside the K candidates), so the acceptor's greedy argmax is the reference's path and its sampled
draws come from a K-sparse proposal that rejection sampling divides by, keeping sampling exact.
Format, conversion and quantization: docs/dflash2.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from .config import DFlashConfig
from .dflash import DFlashDrafter, DraftLayer
from .families import DrafterFamily

ARCHITECTURE = "DFlash2DraftModel"
# The `dflash_config` keys DFlash 2 adds; any of them marks a config as DFlash 2.
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Published checkpoints store the codebooks as bare tensors; our form (and the drafter) names them `.weight`.
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: Optional[int] = None  # taps of each convolution (2 in every published checkpoint)
    conv_group_size: Optional[int] = None  # channels sharing one dynamic coefficient
    selector_rank: Optional[int] = None  # width of the codebooks and of hidden_projection
    selector_top_k: Optional[int] = None  # candidates kept per draft slot

    def __post_init__(self):
        super().__post_init__()
        for key in KEYS:
            value = getattr(self, key)
            if value is None:
                raise DFlashError(f"DFlash 2 drafter config lacks dflash_config.{key}; restore config.json from the "
                                  "drafter's source")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DFlashError(f"DFlash 2 drafter config has dflash_config.{key} = {value!r}; it must be a "
                                  "positive integer (fix config.json or restore it from the drafter's source)")
        if self.hidden_size % self.conv_group_size:
            raise DFlashError(f"DFlash 2 drafter config has dflash_config.conv_group_size {self.conv_group_size}, "
                              f"which does not divide hidden_size {self.hidden_size}; config.json is inconsistent")
        if self.selector_top_k > self.vocab_size:
            raise DFlashError(f"DFlash 2 drafter config has dflash_config.selector_top_k {self.selector_top_k} "
                              f"above vocab_size {self.vocab_size}; config.json is inconsistent")
        if self.draft_vocab_size is not None:
            raise DFlashError("DFlash 2 drafter config has draft_vocab_size; the candidate selector works over the "
                              "target's whole vocabulary: remove draft_vocab_size from config.json")

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "DFlash2Config":
        archs = raw.get("architectures") or []
        if archs and ARCHITECTURE not in archs:
            key = next(k for k in KEYS if k in (raw.get("dflash_config") or {}) or k in raw)
            raise DFlashError(f"drafter config.json names architectures {archs} but has dflash_config.{key}, a "
                              f"DFlash 2 key; set architectures to [\"{ARCHITECTURE}\"] or restore config.json "
                              "from the drafter's source")
        return super().from_dict(raw)

    def to_dict(self) -> Dict[str, Any]:
        out = super().to_dict()
        out["architectures"] = [ARCHITECTURE]
        for key in KEYS:
            out["dflash_config"][key] = out.pop(key)
        return out


def claims(raw: Dict[str, Any]) -> bool:
    """DFlash 2 by its architecture name or by any of its config keys (an inconsistent mix fails in from_dict)."""
    dflash = raw.get("dflash_config") or {}
    return ARCHITECTURE in (raw.get("architectures") or []) or any(k in dflash or k in raw for k in KEYS)


def rename(weights: Dict[str, mx.array], config: DFlash2Config) -> Dict[str, mx.array]:
    """Published names -> parameter names: the bare codebook tensors become embeddings' `.weight`."""
    return {(f"{k}.weight" if k in _CODEBOOKS else k): v for k, v in weights.items()}


class DynamicConv(nn.Module):
    """Grouped dynamic causal convolution over the block rows, applied before (`prepare`) and after (`finish`)
    a sublayer; both coefficient sets come from one projection of the sublayer's normed input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, taps, hidden_size))  # [prepare/finish, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * groups, bias=False)

    def _convolve(self, x: mx.array, dynamic: mx.array, which: int) -> mx.array:
        # x [1, L, H], dynamic [1, L, taps, G]: out[l] = sum_t (base[t] + dynamic[l, t]) * x[l - t], x[<0] = 0.
        b, L, H = x.shape
        groups = H // self.group_size
        rows = x.reshape(b, L, groups, self.group_size)
        out = None
        for t in range(self.taps):
            if t == 0:
                shifted = rows
            elif t < L:
                shifted = mx.pad(rows[:, : L - t], [(0, 0), (t, 0), (0, 0), (0, 0)])
            else:
                continue  # no row has a predecessor this far back
            base = self.base_kernel[which, t].reshape(groups, self.group_size).astype(x.dtype)
            term = (base + dynamic[:, :, t, :, None]) * shifted
            out = term if out is None else out + term
        return out.reshape(x.shape)

    def prepare(self, x: mx.array):
        b, L, H = x.shape
        dynamic = self.kernel_projection(x).reshape(b, L, 2, self.taps, H // self.group_size)
        return self._convolve(x, dynamic[:, :, 0], 0), dynamic[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(y, dynamic, 1)


class DFlash2Layer(DraftLayer):
    """A DFlash draft layer with a dynamic convolution around each sublayer (context K/V injection unchanged)."""

    def __init__(self, config: DFlash2Config, sliding: bool):
        super().__init__(config, sliding)
        self.attention_conv = DynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = DynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        a, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, cache), kernel)
        m, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)


class SelectorWalk:
    """One block's candidates and the selector's scores given the previous slot's token (`acceptance.DraftWalk`)."""

    def __init__(self, selector: CandidateSelector, hidden: mx.array, logits: mx.array):
        # hidden [n, H] final-normed slot states, logits [n, V] the drafter's head logits for them.
        self.selector = selector
        self.length, self.vocab = logits.shape
        self.candidates = mx.argpartition(logits, -selector.top_k, axis=-1)[:, -selector.top_k:]  # [n, K]
        self.unary = mx.take_along_axis(logits, self.candidates, axis=-1)  # [n, K]
        self.successors = selector.successor_codebook(self.candidates)  # [n, K, r]
        self.projected = selector.hidden_projection(hidden)  # [n, r]

    def scores(self, i: int, prev: mx.array) -> mx.array:
        """Scores [K] of slot i's candidates after token `prev` (scalar)."""
        query = self.selector.predecessor_codebook(prev.reshape(())) * self.projected[i]  # [r]
        return self.unary[i] + (self.successors[i] @ query[:, None])[:, 0].astype(self.unary.dtype)

    def row(self, i: int, prev: mx.array) -> mx.array:
        """Logits [V]: slot i's candidate scores in place, -inf elsewhere (the K-sparse proposal)."""
        full = mx.full((self.vocab,), -mx.inf, dtype=self.unary.dtype)
        return mx.put_along_axis(full, self.candidates[i], self.scores(i, prev), axis=0)

    def greedy(self, anchor: mx.array) -> mx.array:
        """The argmax path [n] from `anchor`, choosing among the K candidates only."""
        prev, path = anchor.reshape(()), []
        for i in range(self.length):
            prev = self.candidates[i][mx.argmax(self.scores(i, prev))]
            path.append(prev)
        return mx.stack(path).astype(mx.int32) if path else mx.zeros((0,), dtype=mx.int32)


class DFlash2Drafter(DFlashDrafter):
    """DFlash 2 drafter. Drafts through `draft_walk` (the engine) or `greedy_draft`; bind it before drafting."""

    tree_logits = None  # its rows depend on the previous draft (the candidate selector): no draft trees

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.layers = [DFlash2Layer(config, t == "sliding_attention") for t in config.layer_types]
        self.candidate_selector = CandidateSelector(config)

    def draft_walk(self, block_ids: mx.array, cache: List[KVCache]) -> SelectorWalk:
        """The walk over draft slots 1..B-1 of the block [1, B] = [anchor, MASK x (B-1)]."""
        h = self.hidden_states(block_ids, cache)[0]
        return SelectorWalk(self.candidate_selector, h, self.draft_logits(h))

    def greedy_draft(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Target ids [1, B-1] of the selector's greedy path from the anchor block_ids[0, 0]."""
        return self.draft_walk(block_ids, cache).greedy(block_ids[0, 0])[None]

    def __call__(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Rows [1, B-1, V] of the greedy walk: row i is slot i's selector scores given greedy draft i-1, so the
        argmax of each row is the greedy draft (callers that only take argmaxes of drafter logits stay right)."""
        walk = self.draft_walk(block_ids, cache)
        path = walk.greedy(block_ids[0, 0])
        prevs = [block_ids[0, 0]] + [path[i] for i in range(walk.length - 1)]
        return mx.stack([walk.row(i, p) for i, p in enumerate(prevs)])[None]


FAMILY = DrafterFamily(
    "DFlash 2", claims, DFlash2Config, DFlash2Drafter,
    keep_float=("attention_conv", "mlp_conv", "candidate_selector"),  # small and sensitive: never quantized
    rename=rename,
    marks=("attention_conv.", "mlp_conv.", "candidate_selector."),
)
