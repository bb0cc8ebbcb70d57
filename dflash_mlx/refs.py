"""What a model or drafter reference names: a local path or a Hugging Face Hub repo id, decided by one rule.

A reference is a local path when it exists on disk, or is written as a path (starts with `.`, `/` or `~`, holds
a backslash, or has other than exactly one `/`); otherwise (`org/name`, not on disk) it is a repo id. Short names
of published or offline models are resolved before this question is asked (`loading.resolve_name`).
"""

from __future__ import annotations

from pathlib import Path


def is_repo_id(ref: str) -> bool:
    """Whether `ref` names a hub repo (`org/name`) rather than a local path."""
    ref = str(ref)
    if ref.startswith((".", "/", "~")) or "\\" in ref or ref.count("/") != 1:
        return False
    return not Path(ref).expanduser().exists()
