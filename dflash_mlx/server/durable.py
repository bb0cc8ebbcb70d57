"""Files that survive a crash: written under a temporary name, flushed to the disk, then renamed into place.

`write_durably` hands its writer a temporary path in the target folder, flushes the file (`fsync`), names it with
the sha256 of its bytes and renames it (atomic on one filesystem), then flushes the folder so the new name itself
is on the disk. A `kill -9` or a power cut at any moment leaves the old files and perhaps a temporary one, never a
half-written file under a final name; `verify` tells a file whose bytes no longer match the digest in its name
(a damaged disk, or a file cut short by someone else). Temporary names carry the writer's process id, so leftovers
of a writer that died are recognised (`stale_temporaries`) without touching those of another living process.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Callable, List, Optional

CHUNK = 8 << 20
DIGEST_HEX = 32  # 128 bits of the sha256 in a file name: plenty against damage, short enough to read


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return h.hexdigest()[:DIGEST_HEX]
            h.update(block)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform whose folders cannot be opened: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(prefix: str, suffix: str) -> str:
    return f".{prefix}{os.getpid()}-{secrets.token_hex(6)}.tmp{suffix}"


def write_durably(folder: Path, prefix: str, suffix: str, write: Callable[[Path], None],
                  name_for: Callable[[str], str]) -> Path:
    """Write a file with `write(temporary path)`, then give it the name `name_for(digest)` in `folder`.
    Raises OSError (or what `write` raises) with nothing left behind."""
    tmp = folder / temporary_name(prefix, suffix)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = folder / name_for(sha256_of(tmp))
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    _fsync_folder(folder)
    return final


def verify(path: Path, digest: str) -> bool:
    """Whether the file's bytes still hash to `digest` (False also when it cannot be read)."""
    try:
        return sha256_of(path) == digest
    except OSError:
        return False


def stale_temporaries(folder: Path, prefix: str, suffix: str) -> List[Path]:
    """Temporary files of writers in `folder` whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(prefix)}(\d+)-[0-9a-f]+\.tmp{re.escape(suffix)}")
    stale = []
    for path in folder.glob(f".{prefix}*.tmp{suffix}"):
        match = pattern.fullmatch(path.name)
        if match and not _alive(int(match.group(1))):
            stale.append(path)
    return stale


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def unwritable_reason(folder: Path) -> Optional[str]:
    """None when a file can be created in `folder` (created if missing), else why not, in a few words."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        return e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return None
