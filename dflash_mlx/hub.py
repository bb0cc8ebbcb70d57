"""First use of a hub model: download with progress bars, convert the drafter once, reuse the cached copy.

Converted drafters are cached under `offline_models.home()/drafters/<org>--<name>/<revision>`, keyed by the commit the
download resolved to, so a new upstream revision converts again and an old one is never served by mistake.
Offline, the newest cached conversion is used; with nothing cached the user gets one line saying so.
`fetch_target` does the same for a target repo (mlx-lm's file patterns), so an unreachable hub is named as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import DFlashError


def _drafter_dir(repo: str) -> Path:
    from .offline_models import home

    return home() / "drafters" / repo.replace("/", "--")


def hub_failure(e: BaseException) -> str:
    """Why a hub download failed, in a few words a user can act on."""
    import os

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
    from .convert.drafter import convert_drafter

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


def fetch_target(repo: str, revision: Optional[str] = None) -> Path:
    """The local snapshot of a hub target (the files mlx-lm's loader reads), downloading it if needed."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return _snapshot(repo, revision, DEFAULT_ALLOW_PATTERNS)
    except Exception as e:
        raise DFlashError(f"could not download target '{repo}': {hub_failure(e)}; or pass --model with a local "
                          "model folder") from None
