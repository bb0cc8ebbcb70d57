"""Writes that never leave half a result behind, and write failures that read as one line.

- `output_dir(out, force=...)`: a converter writes into a temporary sibling folder that is renamed into place only
  when everything is written. An existing non-empty `out` is refused unless `force`; with `force` the old folder
  is replaced in one rename at the end, so a failed conversion leaves it untouched.
- `write_text_atomic(path, text)`: a temporary file in the same folder, then `os.replace`.
- `write_error(e, what)`: an `OSError` from a write (disk full, no permission, missing folder) as a `DFlashError`
  that says what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

from .errors import DFlashError

_ADVICE = {
    errno.ENOSPC: "no space left on the device; free some space (or write elsewhere) and run it again",
    errno.EDQUOT: "disk quota exceeded; free some space (or write elsewhere) and run it again",
    errno.EACCES: "permission denied; choose a folder you can write to",
    errno.EPERM: "permission denied; choose a folder you can write to",
    errno.EROFS: "the file system is read-only; choose another folder",
    errno.ENOENT: "its folder does not exist; create it first or choose another path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "it is a folder; give a file name",
}


def _nearly_full(folder: Path, margin: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(folder).free < margin
    except OSError:
        return False


def write_error(e: OSError, what: Union[str, Path]) -> DFlashError:
    """One line for a failed write of `what`: the reason, and what to do about it."""
    advice = _ADVICE.get(e.errno) or f"{e.strerror or e}; check the free space and the folder, then run it again"
    return DFlashError(f"cannot write {what}: {advice}")


def check_output_dir(out: Union[str, Path], force: bool = False) -> Path:
    """`out` as a Path, refusing a file, or a non-empty folder unless `force` (checked before any work starts)."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise DFlashError(f"output '{out}' is a file; give a folder path")
    if out.is_dir() and (out / "config.json").exists() and not force:
        raise DFlashError(f"output folder '{out}' already holds a model (config.json); choose a new folder, or "
                          "pass --force to replace it")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"output folder '{out}' is not empty; choose a new folder, or pass --force to replace "
                          "its contents")
    return out


@contextmanager
def output_dir(out: Union[str, Path], force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it becomes `out`, on any failure it disappears.

    With `force`, an existing `out` is moved aside at the very end and deleted once the new folder is in place.
    """
    out = check_output_dir(out, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise write_error(e, out) from None
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / "dir")  # keep the old folder until the new one is in place
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, out) from None
    except RuntimeError as e:  # MLX's own writer reports a failed write as "[write] Unable to write N bytes"
        full = _nearly_full(out.parent)  # before the partial files are deleted
        shutil.rmtree(tmp, ignore_errors=True)
        if "write" not in str(e).lower():
            raise
        raise write_error(OSError(errno.ENOSPC if full else errno.EIO, str(e)), out) from None
    except BaseException:  # DFlashError, Ctrl-C: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Union[str, Path], text: str) -> Path:
    """Write `text` to `path` through a temporary file, so a reader sees the old file or the new one, never half."""
    path = Path(path).expanduser()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise write_error(e, path) from None
    return path
