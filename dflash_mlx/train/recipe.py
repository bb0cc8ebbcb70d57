"""The training recipe's framework-free parts: where blocks sit, what each slot is labelled, how slots weigh,
which target layers are tapped and which token masks the block.

Everything here is numpy (no MLX), so the MLX trainer (`trainer.py`) and the PyTorch one
(`dflash_mlx.torch_train`) draw the same rows, anchors and labels from the same seed and train the same thing.

A training row is one packed sequence of S tokens. Each anchor a in it makes a block [token a, MASK x (B-1)] at
positions a..a+B-1, exactly what the drafter sees at inference when the committed context ends at a-1 (the token at
a is the last committed one, not yet in the draft cache). Anchors are drawn uniformly among a row's candidates;
`sample_banded_anchors` draws them in position groups (the same chance for every candidate) so that the blocks of
group c need only the context before a fixed limit. Recipe: docs/algorithm.md, "Training".
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..drafters.config import DFlashConfig, default_target_layer_ids
from ..errors import DFlashError


# -- anchors ------------------------------------------------------------------------------------------------------
def anchor_candidates(trainable: np.ndarray, block_size: int) -> np.ndarray:
    """Positions a that may anchor a block: a non-empty context (a >= 1), the whole block inside the row
    (a + B <= S) and a trainable first label (`trainable[a + 1]`, e.g. an assistant token)."""
    last = len(trainable) - block_size  # largest anchor whose block fits
    if last < 1:
        return np.zeros((0,), dtype=np.int64)
    candidates = np.arange(1, last + 1)
    if block_size > 1:
        candidates = candidates[trainable[candidates + 1] > 0]
    return candidates


def sample_anchors(rng: np.random.Generator, trainable: np.ndarray, num_anchors: int, block_size: int) -> np.ndarray:
    """Sorted anchor positions for one row, uniformly among its candidates (`anchor_candidates`).

    Distinct when there are enough candidates, otherwise drawn with replacement so every row yields the same number
    of blocks. Returns [] if the row has none.
    """
    candidates = anchor_candidates(trainable, block_size)
    if len(candidates) == 0:
        return np.zeros((0,), dtype=np.int32)
    picked = rng.choice(candidates, size=num_anchors, replace=len(candidates) < num_anchors)
    return np.sort(picked).astype(np.int32)


def band_limits(context_len: int, bands: int) -> List[int]:
    """Band c's anchors are at most limit c, so its blocks see context positions below it only."""
    return [context_len * (c + 1) // bands for c in range(bands)]


def sample_banded_anchors(rng: np.random.Generator, trainable: np.ndarray, num_anchors: int, block_size: int,
                          bands: int) -> Optional[np.ndarray]:
    """Sorted anchors for one row in `bands` groups of num_anchors / bands, so the training forward can give each
    group a shorter context (`band_limits`): the row's candidates split in position order into `bands` groups of
    equal size (±1), and each group gives the same number of anchors, distinct when it has enough.

    Every candidate has the same chance to be drawn as with `sample_anchors` (anchors per group / group size =
    anchors / candidates); only the spread is more even. None when a group reaches past its band's limit (labels
    bunched late in the row, e.g. one assistant turn at the end) or there are fewer candidates than bands: then
    draw with `sample_anchors` and train without bands.
    """
    candidates = anchor_candidates(trainable, block_size)
    if len(candidates) < bands or num_anchors % bands:
        return None
    groups = np.array_split(candidates, bands)
    if any(g[-1] > limit for g, limit in zip(groups, band_limits(len(trainable), bands))):
        return None
    n = num_anchors // bands
    return np.concatenate([np.sort(rng.choice(g, size=n, replace=len(g) < n)) for g in groups]).astype(np.int32)


def draw_blocks(rng: np.random.Generator, num_rows: int, trainable_of: Callable[[int], np.ndarray],
                rows_per_step: int, num_anchors: int, block_size: int, bands: int) -> Tuple[List[int], np.ndarray, int]:
    """One micro-batch's rows and anchors: (row ids, anchors [R, A], bands used).

    Rows are drawn uniformly among those with at least one anchor candidate; anchors are banded when every drawn
    row allows it, else uniform (bands = 1).
    """
    rows, trainables = [], []
    for _ in range(100 * rows_per_step):
        row = int(rng.integers(num_rows))
        t = np.asarray(trainable_of(row))
        if len(anchor_candidates(t, block_size)):
            rows.append(row)
            trainables.append(t)
        if len(rows) == rows_per_step:
            break
    else:
        raise DFlashError("the data has (almost) no trainable tokens: no block can be placed")
    if bands > 1:
        anchors = [sample_banded_anchors(rng, t, num_anchors, block_size, bands) for t in trainables]
        bands = bands if all(a is not None for a in anchors) else 1
    if bands == 1:
        anchors = [sample_anchors(rng, t, num_anchors, block_size) for t in trainables]
    return rows, np.stack(anchors), bands


def label_positions(anchors: np.ndarray, block_size: int) -> np.ndarray:
    """[R, A, B-1]: the positions block slots 1..B-1 predict (anchor + k)."""
    return anchors[:, :, None] + np.arange(1, block_size)[None, None]


def block_labels(tokens: np.ndarray, trainable: np.ndarray, anchors: np.ndarray, block_size: int,
                 argmax: Optional[np.ndarray] = None, t2d: Optional[np.ndarray] = None) -> np.ndarray:
    """Labels [R, A, B-1] of slots 1..B-1 (-1: no loss) for rows tokens/trainable [R, S] and anchors [R, A].

    `argmax` [R, S] (--labels target): the target's greedy choice for position p comes from its logits at p - 1:
    for slot 1 that is the verify's own answer on this context; later slots see the text's tokens before them.
    Otherwise the text's own next tokens. `t2d` maps target ids into a reduced draft vocabulary (-1: absent).
    """
    at = label_positions(anchors, block_size)
    r = np.arange(len(tokens))[:, None, None]
    labels = np.asarray(argmax)[r, at - 1] if argmax is not None else np.asarray(tokens)[r, at]
    ok = np.asarray(trainable)[r, at] > 0
    if t2d is not None:
        labels = t2d[labels]
        ok &= labels >= 0
    return np.where(ok, labels, -1).astype(np.int32)


# -- the loss's slot weights --------------------------------------------------------------------------------------
def default_gamma(block_size: int) -> float:
    """The recipe's decay: γ = 7 for B=16, 5 for B=10, 4 for B=8 (B/2 up to 10, then one more per 3 slots)."""
    if block_size <= 10:
        return block_size / 2
    return 5 + (block_size - 10) / 3


def slot_weights(block_size: int, gamma: Optional[float] = None) -> np.ndarray:
    """w_k = exp(-(k-1)/γ) for slots k = 1..B-1 (slot 0 holds the known token and has no loss)."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = np.arange(1, block_size, dtype=np.float64)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


# -- the drafter's shape ------------------------------------------------------------------------------------------
def drafter_config(model_args, *, hidden_size: int, num_target_layers: int, vocab_size: int, num_layers: int,
                   block_size: int, mask_token_id: int, taps: Optional[Sequence[int]] = None,
                   intermediate_size: Optional[int] = None, draft_vocab: Optional[int] = None) -> DFlashConfig:
    """A Qwen3-style drafter shaped like the target (hidden size, heads, MLP width unless overridden).

    `model_args`: the target's config object (mlx-lm's `model.args` or a transformers config; may be None).
    """
    get = lambda name, default=None: getattr(model_args, name, None) or default  # noqa: E731
    H = hidden_size
    heads = get("num_attention_heads", max(1, H // 64))
    return DFlashConfig(
        hidden_size=H, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", heads), head_dim=get("head_dim", H // heads),
        intermediate_size=intermediate_size or get("intermediate_size", 4 * H), vocab_size=vocab_size,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(get("rope_theta", 1e6)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)), num_target_layers=num_target_layers,
        block_size=block_size, target_layer_ids=list(taps or default_target_layer_ids(num_target_layers, num_layers)),
        mask_token_id=mask_token_id, draft_vocab_size=draft_vocab)


def step_flops(c: DFlashConfig, rows: int, anchors: int, seq_len: int) -> float:
    """Training FLOPs of one micro-batch (multiply-adds x 2): forward + backward of the trained matmuls (x3), the
    frozen head's forward and input gradient (x2), and the fusion `fc` (forward + weight gradient, x2)."""
    H, B, L = c.hidden_size, c.block_size, c.num_hidden_layers
    hd = c.head_dim or H // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    blocks = rows * anchors * B  # block tokens
    vocab = c.draft_vocab_size or c.vocab_size
    per_layer = (blocks * (H * (q + 2 * kv) + q * H + 3 * H * c.intermediate_size)
                 + rows * seq_len * H * 2 * kv  # context keys and values
                 + blocks * c.num_attention_heads * hd * (seq_len + B) * 2)  # scores and weighted values
    head = rows * anchors * (B - 1) * H * vocab
    fc = rows * seq_len * c.num_taps * H * H
    return 2.0 * (3 * L * per_layer + 2 * head + 2 * fc)


def default_taps(num_target_layers: int, count: int) -> List[int]:
    """The reference's spread (layer 1 to L-3); on targets too shallow for it, spread over every layer."""
    taps = default_target_layer_ids(num_target_layers, count)
    if len(set(taps)) < len(taps):
        taps = sorted({int(round(x)) for x in np.linspace(0, num_target_layers - 1, count)})
    return taps


def choose_mask_token(tokenizer, vocab_size: int, tokens: np.ndarray, has_embedding: Callable[[int], bool],
                      reserved: Sequence[int] = ()) -> int:
    """A token that never occurs in the data and has a non-zero embedding (`has_embedding(id)`): a '...mask...'
    special token if the tokenizer has one, else its highest added token that is not BOS/EOS/PAD or `reserved`."""
    # mlx-lm's wrapper forwards to the transformers tokenizer; a transformers tokenizer's own `_tokenizer` is the
    # Rust one, without get_added_vocab.
    hf = tokenizer if hasattr(tokenizer, "get_added_vocab") else getattr(tokenizer, "_tokenizer", tokenizer)
    added = dict(getattr(hf, "get_added_vocab", lambda: {})())
    used = set(np.unique(np.asarray(tokens)).tolist())
    eos = getattr(tokenizer, "eos_token_ids", None) or []
    excluded = set([eos] if isinstance(eos, int) else eos) | set(reserved) | {
        getattr(hf, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    names = sorted(added.items(), key=lambda kv: (("mask" not in kv[0].lower()), -kv[1]))
    for _, i in names:
        if i in used or i in excluded or not 0 <= i < vocab_size:
            continue
        if has_embedding(int(i)):
            return int(i)
    raise DFlashError("found no unused special token to serve as the mask token; pass --mask-token-id ID")
