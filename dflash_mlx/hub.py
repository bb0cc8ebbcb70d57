"""First use of a hub model: download with progress bars, convert the drafter once, reuse the cached copy.

Converted drafters are cached under `models.home()/drafters/<org>--<name>/<revision>`, keyed by the commit the
download resolved to, so a new upstream revision converts again and an old one is never served by mistake.
Offline, the newest cached conversion is used; with nothing cached the user gets one line saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import DFlashError


def _drafter_dir(repo: str) -> Path:
    from .models import home

    return home() / "drafters" / repo.replace("/", "--")


def _snapshot(repo: str, revision: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors"]
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as online_error:  # offline, unknown repo, auth: try what the hub cache already has
        try:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=True))
        except Exception:
            raise online_error


def cached_drafter(repo: str, revision: Optional[str] = None) -> Path:
    """A converted MLX copy of the hub drafter `repo`, converting it on first use."""
    from .convert.drafter import convert_drafter

    try:
        snapshot = _snapshot(repo, revision)
    except Exception as e:
        converted = sorted(_drafter_dir(repo).glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if converted and revision is None:
            return converted[-1].parent
        raise DFlashError(
            f"could not download drafter '{repo}' ({type(e).__name__}) and no converted copy is cached; "
            "connect to the internet once, or pass --draft with a local directory"
        ) from e
    out = _drafter_dir(repo) / snapshot.name  # snapshot folders are named by commit hash
    if not (out / "config.json").is_file():
        print(f"Converting drafter {repo} for MLX (once) -> {out}")
        convert_drafter(str(snapshot), out, force=True)  # our cache: a leftover without config.json is junk
    return out
