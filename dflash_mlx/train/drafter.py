"""The drafter a run trains, as it starts: its configuration from the target and the recipe (`drafter_config`),
and the weights it starts from that come from the target: the output norm's gain (`output_scale`), the mask token
(`pick_mask_token`) and, with --draft-vocab, the reduced head (`build_training_drafter` puts them together)."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from .args import TrainArgs
from .recipe import choose_mask_token
from .recipe import drafter_config as recipe_drafter_config


def drafter_config(target, model, args: TrainArgs, mask_token_id: int):
    """`recipe.drafter_config` for an mlx-lm target (its `model.args`)."""
    return recipe_drafter_config(getattr(model, "args", None), hidden_size=target.hidden_size,
                                 num_target_layers=target.num_layers, vocab_size=target.vocab_size,
                                 num_layers=args.num_layers, block_size=args.block_size, mask_token_id=mask_token_id,
                                 taps=args.target_layers, intermediate_size=args.intermediate_size,
                                 draft_vocab=args.draft_vocab)


def output_scale(target, default):
    """The drafter's final-norm weight to start from: the target's own final-norm gain.

    The drafter's output goes through the target's head, whose logits are calibrated for the target's normed
    residual stream. RMSNorm removes magnitude, so this gain alone sets the logit scale, and AdamW moves it only
    about `lr` per step: starting far off (Qwen2.5's gain averages ~7) leaves the loss near log V for thousands of
    steps. norm(ones) reads the gain whatever the norm's parametrization (Gemma's 1 + w included).
    """
    import mlx.core as mx

    norm = getattr(target.inner, "norm", None)
    if norm is None:
        return default * 0.1  # unknown layout: start near a uniform guess rather than with huge logits
    gain = norm(mx.ones((1, target.hidden_size), dtype=mx.float32))[0]
    return gain.astype(default.dtype) if gain.shape == default.shape else default * 0.1


def pick_mask_token(tokenizer, target, tokens: np.ndarray) -> int:
    """`recipe.choose_mask_token` with the MLX target's embedding."""
    import mlx.core as mx

    return choose_mask_token(tokenizer, target.vocab_size, tokens,
                             lambda i: mx.abs(target.embed(mx.array([[i]]))).sum().item() > 0)


def build_training_drafter(args: TrainArgs, model, tokenizer, target, cache, saved: Optional[Dict]):
    """The drafter to train: a new one seeded by the target, or (`saved`: a checkpoint's trainer.json) one shaped as
    the checkpoint's, whose weights `Trainer.load` then restores. Picks `args.mask_token_id` when none was given."""
    import mlx.core as mx

    from ..drafters.config import DFlashConfig
    from ..drafters.io import build_drafter
    from .vocab import head_rows, maps, select_vocab

    if saved is not None:
        config = DFlashConfig.from_dict(saved["drafter_config"])
    else:
        if args.mask_token_id is None:
            args.mask_token_id = pick_mask_token(tokenizer, target, cache.tokens)
        config = drafter_config(target, model, args, args.mask_token_id)
    mx.random.seed(args.seed)
    drafter = build_drafter(config)
    if saved is None:
        drafter.norm.weight = output_scale(target, drafter.norm.weight)
    if config.draft_vocab_size and saved is None:  # on resume the head and d2t come with the checkpoint
        labels, mask = np.asarray(cache.tokens), np.asarray(cache.trainable)
        if args.labels == "target" and cache.argmax() is not None:
            # The tokens trained on are the target's choices: argmax[p] labels position p + 1.
            labels, mask = np.asarray(cache.argmax())[:, :-1], mask[:, 1:]
        ids = select_vocab(labels, mask, config.draft_vocab_size, config.vocab_size,
                           always=getattr(tokenizer, "eos_token_ids", None) or [])
        drafter.d2t = mx.array(maps(ids, config.vocab_size)[0])
        drafter.lm_head.weight = head_rows(target, ids)
    mx.eval(drafter.parameters())
    return drafter
