"""Writes that never leave half a result behind, and write failures that read as one line.

- `output_dir(out, force=..., sources=...)`: a converter writes into a temporary sibling folder that is renamed into
  place only when everything is written. An existing non-empty `out` is refused unless `force`; with `force` the
  old folder is replaced in one rename at the end, so a failed conversion leaves it untouched. An `out` that is,
  holds or lies inside a source, or is the current folder, the home folder or a filesystem root, is always
  refused. SIGTERM, SIGHUP and Ctrl-C unwind like an exception, so the temporary folder goes too; one left by a
  killed run (SIGKILL, power loss) is removed by the next run into the same `out`.
- `write_text_atomic(path, text)`: a temporary file in the same folder, then `os.replace`.
- `write_error(e, what)`: an `OSError` from a write (disk full, no permission, missing folder) as a `DFlashError`
  that says what to do.

Folders and files are created with the modes a plain `mkdir` / `open` would give (the user's umask), never the
0700 / 0600 of `tempfile.mkdtemp` / `mkstemp`: the result is the user's model, not a secret.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

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


# -- which folders may be written (and replaced) -----------------------------------------------------------
def _real(path: Union[str, Path]) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _check_not_precious(out: Path) -> None:
    """Refuse a filesystem root, the current folder, the home folder, or a folder holding either of them:
    replacing one with --force would delete the user's files, and renaming onto '.' fails half-way."""
    real = _real(out)
    if real.parent == real:
        raise DFlashError(f"output folder '{out}' is a filesystem root; give a new folder for the converted model")
    try:
        cwd: Optional[Path] = Path(os.path.realpath(os.getcwd()))
    except OSError:  # the current folder was deleted: nothing to protect there
        cwd = None
    if cwd is not None and real == cwd:
        raise DFlashError(f"output folder '{out}' is the current folder; give a new folder for the converted model, "
                          f"e.g. '{Path(out) / 'converted'}'")
    if cwd is not None and real in cwd.parents:
        raise DFlashError(f"output folder '{out}' holds the current folder; give a new folder for the converted "
                          "model")
    home = _real(os.path.expanduser("~"))
    if real == home or real in home.parents:
        what = "is your home folder" if real == home else "holds your home folder"
        raise DFlashError(f"output folder '{out}' {what}; give a new folder for the converted model")


def _check_apart(out: Path, source: Union[str, Path]) -> None:
    """`out` must neither be, hold, nor lie inside `source`: the source is read lazily while `out` is written,
    and `--force` deletes the old `out` with everything in it."""
    o, s = _real(out), _real(source)
    what = "source directory" if s.is_dir() else "source file"
    if o == s:
        raise DFlashError(f"output folder '{out}' is the {what} '{source}'; choose another folder")
    if s in o.parents:
        raise DFlashError(f"output folder '{out}' is inside the {what} '{source}'; choose a folder outside it")
    if o in s.parents:
        raise DFlashError(f"output folder '{out}' holds the {what} '{source}' (replacing it would delete the "
                          "source); choose another folder")


def check_output_dir(out: Union[str, Path], force: bool = False, sources: Iterable[Union[str, Path]] = ()) -> Path:
    """`out` as a Path, checked before any work starts: refuse a file, a folder that overlaps one of the local
    `sources`, a root / current / home folder, and a non-empty folder unless `force`."""
    out = Path(out).expanduser()
    _check_not_precious(out)
    for source in sources:
        _check_apart(out, source)
    if out.exists() and not out.is_dir():
        raise DFlashError(f"output '{out}' is a file; give a folder path")
    if out.is_dir() and (out / "config.json").exists() and not force:
        raise DFlashError(f"output folder '{out}' already holds a model (config.json); choose a new folder, or "
                          "pass --force to replace it")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"output folder '{out}' is not empty; choose a new folder, or pass --force to replace "
                          "its contents")
    return out


# -- temporary folders: named after `out` and this process, so a killed run's can be told apart ------------
_MADE_HERE = set()  # temporary folders this process created and has not yet renamed or removed


def _new_dir(parent: Path, name: str, suffix: str) -> Path:
    """A new folder `.NAME.PID.RANDOM.SUFFIX` in `parent`, mode as a plain mkdir gives (0777 less the umask)."""
    for _ in range(100):
        path = parent / f".{name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        _MADE_HERE.add(os.path.realpath(path))
        return path
    raise OSError(errno.EEXIST, "no free temporary folder name", str(parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def remove_stale_partials(out: Path) -> None:
    """Delete the `.OUT.PID.RANDOM.partial` folders that runs into `out` left when killed (their process is gone),
    and `.OUT.RANDOM.partial` ones from versions before the PID was in the name. Nothing else is touched."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:(\d+)\.[0-9a-f]{{8}}|[a-z0-9_]{{8}})\.partial")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for path in entries:
        m = pattern.fullmatch(path.name)
        if m is None or not path.is_dir() or path.is_symlink() or os.path.realpath(path) in _MADE_HERE:
            continue
        pid = int(m.group(1)) if m.group(1) else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue  # another conversion into the same folder is running now
        shutil.rmtree(path, ignore_errors=True)


class _Unwind:
    """While active: SIGTERM / SIGHUP raise `Terminated` and Ctrl-C raises KeyboardInterrupt (only where their
    handler would otherwise kill the process or already raises), so `output_dir` can remove its partial folder.
    `hold()` defers them while the final renames run, so a signal never splits the swap of old and new; a
    deferred signal is re-sent, to the handler that was there before, on leaving."""

    def __init__(self) -> None:
        self.previous = {}
        self.held = False
        self.pending: Optional[int] = None

    def _handler(self, signum, frame):
        if self.held:
            self.pending = signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def hold(self) -> None:
        self.held = True

    def __enter__(self) -> "_Unwind":
        for name, unhandled in (("SIGTERM", signal.SIG_DFL), ("SIGHUP", signal.SIG_DFL),
                                ("SIGINT", signal.default_int_handler)):
            signum = getattr(signal, name, None)
            if signum is None or signal.getsignal(signum) is not unhandled:
                continue  # ignored (nohup) or handled by the caller: leave it as it is
            try:
                self.previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: signals cannot be set here
                break
        return self

    def __exit__(self, kind, value, tb) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if self.pending is not None and kind is None:
            signal.raise_signal(self.pending)  # the work is complete; now the signal does what it would have


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) while a converter writes: unwinds like Ctrl-C (exit 130, `interrupted` on the command
    line), so the partial output is removed on the way out."""


@contextmanager
def output_dir(out: Union[str, Path], force: bool = False,
               sources: Iterable[Union[str, Path]] = ()) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it becomes `out`, on any failure it disappears.

    With `force`, an existing `out` is moved aside at the very end and deleted once the new folder is in place.
    `sources`: local paths the conversion reads, which `out` must not be, hold or lie inside.
    """
    out = check_output_dir(out, force, sources)
    with _Unwind() as guard:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(out)
            tmp = _new_dir(out.parent, out.name, ".partial")
        except OSError as e:
            raise write_error(e, out) from None
        try:
            yield tmp
            guard.hold()
            old = None
            if out.exists():
                old = _new_dir(out.parent, out.name, ".old")
                os.replace(out, old / "dir")  # keep the old folder until the new one is in place
            os.replace(tmp, out)
            _MADE_HERE.discard(os.path.realpath(tmp))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
                _MADE_HERE.discard(os.path.realpath(old))
        except OSError as e:
            guard.hold()
            _remove(tmp)
            raise write_error(e, out) from None
        except RuntimeError as e:  # MLX's own writer reports a failed write as "[write] Unable to write N bytes"
            guard.hold()
            full = _nearly_full(out.parent)  # before the partial files are deleted
            _remove(tmp)
            if "write" not in str(e).lower():
                raise
            raise write_error(OSError(errno.ENOSPC if full else errno.EIO, str(e)), out) from None
        except BaseException:  # DFlashError, Ctrl-C, SIGTERM: nothing half-written stays behind
            guard.hold()
            _remove(tmp)
            raise


def _remove(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    _MADE_HERE.discard(os.path.realpath(tmp))


def write_text_atomic(path: Union[str, Path], text: str) -> Path:
    """Write `text` to `path` through a temporary file, so a reader sees the old file or the new one, never half.

    The file gets the mode an overwrite in place would keep (the old file's), or for a new file the umask's.
    A symlink is written through: the file it points to is replaced (the temporary file sits next to it) and the
    link is kept."""
    path = Path(path).expanduser()
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    tmp = None
    try:
        for _ in range(100):
            tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                tmp = None
        else:
            raise OSError(errno.EEXIST, "no free temporary file name", str(path.parent))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        except FileNotFoundError:
            pass
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise write_error(e, path) from None
    return path
