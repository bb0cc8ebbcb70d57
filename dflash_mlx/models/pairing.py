"""Checks that a drafter fits a target before any token is drafted; each failure is one actionable line.

`check_pair` only checks: it changes neither the target nor the drafter (`loading.prepare` sets the taps).
"""

from __future__ import annotations

from ..drafters.config import DFlashConfig
from ..errors import DFlashError
from ..targets import TargetModel


def check_pair(target: TargetModel, config: DFlashConfig) -> None:
    hidden = getattr(config, "target_hidden_size", None) or config.hidden_size  # the width its taps must have
    if hidden != target.hidden_size:
        raise DFlashError(
            f"drafter hidden size {hidden} does not match the target's {target.hidden_size}; "
            "use the drafter published for this target"
        )
    if config.vocab_size != target.vocab_size:
        raise DFlashError(
            f"drafter vocabulary ({config.vocab_size}) does not match the target's ({target.vocab_size}); "
            "use the drafter published for this target"
        )
    if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
        raise DFlashError(
            f"drafter was trained for a {config.num_target_layers}-layer target but this target has "
            f"{target.num_layers} layers; use the drafter published for this target"
        )
    if config.mask_token_id is None and getattr(config, "needs_mask", True):  # MTP layers draft without one
        raise DFlashError("drafter config has no mask_token_id (the token that fills a block's draft slots); "
                          "add it to the drafter's config.json")
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target vocabulary (0..{target.vocab_size - 1})"
        )
    target.check_taps(config.target_layer_ids)  # its own clear error for out-of-range layer ids
