"""First use of a hub model: download with progress bars, convert the drafter once, reuse the cached copy.

Converted drafters are cached under `models.offline.home()/drafters/<org>--<name>/<revision>`, keyed by the commit the
download resolved to, so a new upstream revision converts again and an old one is never served by mistake.
Offline, the newest cached conversion is used; with nothing cached the user gets one line saying so.
`fetch_target` does the same for a target repo (mlx-lm's file patterns), so an unreachable hub is named as such.

The top of the drafter stack: `drafters.io` (files) < `convert.drafter` (conversion) < this module (download and
cache). `open_drafter` is the one entry that loads a drafter from a directory or a repo id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..convert.drafter import convert_drafter
from ..drafters.dflash import DFlashDrafter
from ..drafters.io import load_drafter
from ..errors import DFlashError
from ..refs import is_repo_id
from ..validate import hub_failure
from .offline import home

__all__ = ["cached_drafter", "fetch_target", "hub_failure", "is_repo_id", "open_drafter"]


def _drafter_dir(repo: str) -> Path:
    return home() / "drafters" / repo.replace("/", "--")


def _snapshot(repo: str, revision: Optional[str], patterns=("*.json", "*.safetensors")) -> Path:
    from huggingface_hub import snapshot_download

    patterns = list(patterns)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as online_error:  # offline, unknown repo, auth: try what the hub cache already has
        try:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=True))
        except Exception:
            raise online_error


def cached_drafter(repo: str, revision: Optional[str] = None) -> Path:
    """A converted MLX copy of the hub drafter `repo`, converting it on first use."""
    try:
        snapshot = _snapshot(repo, revision)
    except Exception as e:
        converted = sorted(_drafter_dir(repo).glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if converted and revision is None:
            return converted[-1].parent
        raise DFlashError(
            f"could not download drafter '{repo}': {hub_failure(e)}; no converted copy is cached: connect to the "
            "internet once, or pass --draft with a local directory"
        ) from None
    out = _drafter_dir(repo) / snapshot.name  # snapshot folders are named by commit hash
    if not (out / "config.json").is_file():
        print(f"Converting drafter {repo} for MLX (once) -> {out}")
        convert_drafter(str(snapshot), out, force=True)  # our cache: a leftover without config.json is junk
    return out


def open_drafter(ref: str, revision: Optional[str] = None, *, fastest: bool = False) -> DFlashDrafter:
    """A ready drafter from a converted or z-lab directory, or a hub repo id (converted once into the cache).

    `fastest` as in `drafters.io.load_drafter`. The same as `loading.load` does with `drafter_location`.
    """
    source = cached_drafter(ref, revision) if is_repo_id(ref) else ref
    return load_drafter(source, revision=revision, fastest=fastest)


def fetch_target(repo: str, revision: Optional[str] = None) -> Path:
    """The local snapshot of a hub target (the files mlx-lm's loader reads), downloading it if needed."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return _snapshot(repo, revision, DEFAULT_ALLOW_PATTERNS)
    except Exception as e:
        raise DFlashError(f"could not download target '{repo}': {hub_failure(e)}; or pass --model with a local "
                          "model folder") from None
