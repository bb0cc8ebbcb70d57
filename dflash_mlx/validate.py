"""Checks that turn a bad input into one line saying what to do, before hours of work or a cryptic failure.

- `check_safetensors(path)`: a 0-byte, truncated or garbled weights file, named, with the fix (MLX itself reports
  "Unable to read 8 bytes from file" without saying which file).
- `check_model_dir(path)`: a target folder's config.json and weights files, before mlx-lm reads gigabytes.
- `prompt_length_warning` / `width_warning`: runs that would go on, but not the way the user expects.
- `hub_failure(e)`: why a Hugging Face Hub download failed, in a few words (every download path words it alike).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .errors import DFlashError

# Prompts above this many tokens get a prefill progress bar on the command line.
LONG_PROMPT_TOKENS = 2048


def check_safetensors(file: Union[str, Path], fix: str = "delete it and download or convert the model again") -> None:
    """Raise a DFlashError if `file` is not a complete safetensors file: its header and data must fit in it."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DFlashError(f"weights file {file} is {'empty' if size == 0 else 'truncated'} "
                                  f"({size} bytes); {fix}")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise DFlashError(f"weights file {file} is truncated or not safetensors (header of {header_len} "
                                  f"bytes, file of {size}); {fix}")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise DFlashError(f"cannot read weights file {file} ({e.strerror or e}); check the path and permissions") \
            from None
    except (ValueError, UnicodeDecodeError):
        raise DFlashError(f"weights file {file} has a garbled header, so it is not a safetensors file; {fix}") \
            from None
    if not isinstance(header, dict):
        raise DFlashError(f"weights file {file} has a garbled header; {fix}")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise DFlashError(f"weights file {file}: tensor '{name}' has no valid data_offsets; {fix}") from None
    if 8 + header_len + end > size:
        raise DFlashError(f"weights file {file} is truncated ({size} bytes, its header needs "
                          f"{8 + header_len + end}); {fix}")


def read_json(file: Path, missing: str, unparsable: Callable[[Exception], str]) -> Any:
    """The parsed JSON in `file`; one-line errors: `missing` when it is absent, `unparsable(e)` when unreadable."""
    if not file.is_file():
        raise DFlashError(missing)
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(unparsable(e)) from None


def check_model_dir(path: Union[str, Path], what: str = "target") -> None:
    """A local model folder: readable config.json with a model_type, and complete safetensors files."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise DFlashError(f"{what} '{path}' is a file; give the model's folder (the one holding config.json and the "
                          "*.safetensors files)")
    config = path / "config.json"
    raw = read_json(config, f"{what} '{path}' has no config.json; point at an mlx-lm model folder",
                    lambda e: f"{what} config {config} cannot be parsed ({e}); restore or re-download it")
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise DFlashError(f"{what} config {config} names no model_type; is this a model folder?")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{what} '{path}' has no *.safetensors weights; download or convert the model again")
    for file in files:
        check_safetensors(file, fix=f"delete {path} and download or convert the {what} again")


def check_max_tokens(max_tokens: int, flag: str = "--max-tokens") -> None:
    """-1 (no limit) or a positive count; anything else is a mistake, not a silent 'unlimited'."""
    if max_tokens == -1 or max_tokens > 0:
        return
    raise DFlashError(f"{flag} must be a positive number of tokens, or -1 for no limit; got {max_tokens}")


def prompt_length_warning(prompt_tokens: int, max_position_embeddings: Optional[int]) -> Optional[str]:
    """A warning line when the prompt is longer than the target was trained for (output may degrade)."""
    if max_position_embeddings and prompt_tokens > max_position_embeddings:
        return (f"the prompt has {prompt_tokens} tokens, more than the target's max_position_embeddings "
                f"({max_position_embeddings}); output may be poor and prefill slow: shorten the prompt")
    return None


def width_warning(requested: Optional[int], drafter_block: Optional[int]) -> Optional[str]:
    """A warning when --width exceeds the block the drafter was trained for (extra slots are rarely kept)."""
    if requested is not None and drafter_block and requested > drafter_block:
        return (f"--width {requested} is larger than the drafter's trained block size {drafter_block}; "
                f"drafts past position {drafter_block} are rarely accepted: use --width {drafter_block} or less")
    return None


def hub_failure(e: BaseException) -> str:
    """Why a hub download failed, in a few words a user can act on."""
    text = f"{type(e).__name__}: {e}"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or "outgoing traffic has been " \
            "disabled" in text:
        return "offline mode is on (HF_HUB_OFFLINE) and the files are not in the local cache"
    if "RepositoryNotFound" in text or "404" in text:
        return "no such repo, or it is private or gated (log in with 'hf auth login')"
    if "RevisionNotFound" in text:
        return "no such revision"
    if any(k in text for k in ("ConnectError", "Connection refused", "ConnectionError", "Timeout", "resolve")):
        return "the Hugging Face Hub cannot be reached (check your network, proxy or HF_ENDPOINT)"
    return (text.strip().splitlines() or [type(e).__name__])[0][:200]
