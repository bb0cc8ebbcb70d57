"""Loading a target split over the ranks of a group, the way mlx-lm's `sharded_load` does it.

Tensor parallel (default): mlx-lm's `model.shard(group)` splits every attention and MLP (and GatedDeltaNet, and a
Qwen3.5 LM head) by heads or columns; each layer ends in an all-sum, so the residual stream, the tapped features
and the logits are whole on every rank. Pipeline parallel (`pipeline=True`): mlx-lm's `model.model.pipeline(group)`
gives each rank a contiguous stage of layers (see `pipeline.py`).

Weights load lazily and only this rank's slice (or stage) is ever read. Every rank loads the same files and
shards them itself; the drafter is loaded whole on every rank and drafts identically there (no broadcast).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError
from ..models.loading import check_family
from ..refs import is_repo_id
from ..targets.adapter import model_type_of
from ..targets.families import text_lm
from .group import barrier, rank0_first, setup
from .pipeline import FeatureExchange, make_target

# Config fields mlx-lm's `shard` splits evenly across ranks.
_HEAD_FIELDS = ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads")
_WIDTH_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# Families whose `shard` repeats key/value heads when there are more ranks than heads.
_REPEATS_KV = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _divisors(n: int, limit: int = 16) -> str:
    return ", ".join(str(d) for d in range(2, min(n, limit) + 1) if n % d == 0) or "none"


def check_shardable(model: nn.Module, size: int, pipeline: bool = False) -> None:
    """Refuse, in one line, a model this many ranks cannot split (before any weight is read)."""
    model_type = model_type_of(model)
    inner = getattr(model, "model", None)
    can_pipeline = inner is not None and hasattr(inner, "pipeline")
    if pipeline:
        if not can_pipeline:
            raise DFlashError(f"target '{model_type}' cannot be split into pipeline stages (its mlx-lm model has no "
                              "`pipeline` method); drop --pipeline to split it by heads instead")
        layers = len(inner.layers)
        if layers < size:
            raise DFlashError(f"{size} ranks need at least {size} layers to split into stages; the target has {layers}")
        return
    if not callable(getattr(model, "shard", None)):
        hint = "; use --pipeline to split it by layers" if can_pipeline else "; run it on one machine"
        raise DFlashError(f"target '{model_type}' cannot be split by heads (its mlx-lm model has no tensor-parallel "
                          f"`shard` method){hint}")
    args = getattr(text_lm(model), "args", None)
    for name in _HEAD_FIELDS + _WIDTH_FIELDS + ("num_key_value_heads",):
        value = getattr(args, name, None)
        if not isinstance(value, int) or value <= 0 or value % size == 0:
            continue
        if name == "num_key_value_heads" and model_type in _REPEATS_KV and size % value == 0:
            continue  # each rank gets a copy of a key/value head
        raise DFlashError(f"{size} ranks cannot split the target's {name} ({value}) evenly; use a rank count that "
                          f"divides it ({_divisors(value)})")


def shard_model(model: nn.Module, group: mx.distributed.Group, pipeline: bool = False) -> nn.Module:
    """Split a lazily loaded mlx-lm model over `group` in place, then read this rank's weights."""
    check_shardable(model, group.size(), pipeline)
    try:
        if pipeline:
            model.model.pipeline(group)
        else:
            model.shard(group)
    except (ValueError, AssertionError) as e:  # mlx-lm's own shape checks
        raise DFlashError(f"cannot split target '{model_type_of(model)}' over {group.size()} ranks: {e}") from e
    mx.eval(model.parameters())
    barrier(group)  # a slow loader on one rank must not look like a hang to the others
    return model


def load_sharded_model(path: str, group: mx.distributed.Group, pipeline: bool = False) -> nn.Module:
    """A local mlx-lm model directory, split over `group` (no tokenizer needed)."""
    from mlx_lm.utils import load_model

    check_family(Path(path), str(Path(path)), unreadable="has no readable config.json")
    model, _ = load_model(Path(path), lazy=True)
    return shard_model(model, group, pipeline)


def target_path(target: str, revision: Optional[str] = None) -> Path:
    """The local folder of a target given as a local directory or a hub repo id (fetched into the hub cache)."""
    from ..models.hub import fetch_target

    local = Path(target).expanduser()
    if local.exists():
        return local
    if not is_repo_id(target):
        raise DFlashError(f"target '{target}' not found: give a local model directory or a hub repo id (org/name)")
    return fetch_target(target, revision)  # one line when the hub cannot serve it


def _local_files(target: str, drafter: Optional[str], quant: Optional[str], revision: Optional[str],
                 draft_revision: Optional[str]) -> Tuple[Path, str]:
    """Resolve names and fetch files exactly as `dflash_mlx.load` does (offline names, registry, hub)."""
    from ..models.loading import drafter_location, is_short_name, resolve_name

    if is_short_name(target):
        target, drafter = resolve_name(target, quant, drafter)
    elif quant is not None:
        raise DFlashError("--quant applies to registry names only (see 'dflash-mlx models')")
    if drafter is None:
        raise DFlashError("no drafter given: pass --draft (a DFlash drafter for this target)")
    return target_path(target, revision), drafter_location(drafter, draft_revision)


def load(
    path_or_hf_repo: str,
    drafter: Optional[str] = None,
    *,
    pipeline: bool = False,
    quant: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
):
    """`dflash_mlx.load` for one rank of a job started by `mlx.launch`: the target split over the ranks.

    Args:
        path_or_hf_repo, drafter, quant, tokenizer_config, revision, draft_revision: as in `dflash_mlx.load`.
        pipeline: split the layers into stages instead of splitting every layer by heads.

    Returns:
        (model, tokenizer, drafter), to pass to `stream_generate` / `generate` on every rank; only rank 0 prints.
        With `pipeline`, the drafter comes wrapped so that it receives the tapped features of every stage.
    """
    from mlx_lm.utils import load_tokenizer

    from ..drafters.io import load_drafter
    from ..models.loading import prepare

    group = setup()
    with rank0_first(group):  # downloads and drafter conversions write one shared cache
        path, drafter_path = _local_files(path_or_hf_repo, drafter, quant, revision, draft_revision)
        draft_model = load_drafter(drafter_path, revision=draft_revision)
    model = load_sharded_model(str(path), group, pipeline)
    config = json.loads((path / "config.json").read_text())
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    prepare(make_target(model), draft_model, probe=True)  # a stage's target for a pipeline, built here
    if pipeline:
        draft_model = FeatureExchange(draft_model)
    return model, tokenizer, draft_model
