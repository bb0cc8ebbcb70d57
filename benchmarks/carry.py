"""Carry a large file to or from a remote GPU machine in pieces small enough for its transfers.

The remote machines take back and hand over only a few files of at most 16 MiB each per command, while what has
to travel is larger: a 491 MB GGUF target, an 86 MB wheel, a trained drafter. `split` cuts the file into numbered
pieces (15 MiB by default) next to a JSON manifest naming the file, its total size and sha256, and each piece's
name, size and sha256. The pieces may travel over several commands and land in one folder or several; `join` finds
them, checks every piece and then the whole against the manifest, and reassembles the file atomically (written to
a temporary name, fsynced, renamed into place). A missing piece, one of the wrong size or one whose checksum differs
stops it with one line on stderr naming the piece and exit status 2, and leaves no output file behind.

    python benchmarks/carry.py split FILE OUTDIR [--piece-mib 15]
    python benchmarks/carry.py join MANIFEST [--pieces DIR ...] [--out PATH]
    python benchmarks/carry.py check MANIFEST [--pieces DIR ...]
    python benchmarks/carry.py pack OUTDIR FILE ... [--load-mib 56] [--piece-mib 14]

`pack` lays several files out as numbered loads (OUTDIR/00, 01, ...: one per command, each at most --load-mib),
in the order given: a file larger than a piece is split and its pieces fill the loads in turn, its manifest riding
with its last piece (so a file can be joined as soon as the load that completes it has arrived); a smaller file
travels whole.

Pieces are looked up in the manifest's own folder, then in each --pieces folder. `check` lists each piece as
valid, bad or missing and exits 0 only when all are valid (1 otherwise, 2 on an unreadable manifest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

CHUNK = 1 << 20  # streaming buffer: no piece or file is ever read whole into memory
MANIFEST_SUFFIX = ".manifest.json"


class CarryError(Exception):
    """A piece or manifest problem; the CLI prints it as one line and exits 2."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def split(path, outdir, piece_bytes: int = 15 << 20, echo=None) -> Path:
    """Cut `path` into pieces of `piece_bytes` in `outdir`; returns the manifest's path (written last)."""
    path, outdir = Path(path), Path(outdir)
    if piece_bytes <= 0:
        raise CarryError(f"piece size must be positive, got {piece_bytes}")
    if not path.is_file():
        raise CarryError(f"{path}: no such file")
    outdir.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    width = max(3, len(str(max(0, -(-size // piece_bytes) - 1))))
    whole = hashlib.sha256()
    pieces = []
    with open(path, "rb") as src:
        while True:
            name = f"{path.name}.part{len(pieces):0{width}d}"
            h, n = hashlib.sha256(), 0
            chunk = src.read(min(CHUNK, piece_bytes))
            if not chunk:
                break
            with open(outdir / name, "wb") as dst:
                while chunk:
                    dst.write(chunk)
                    h.update(chunk)
                    whole.update(chunk)
                    n += len(chunk)
                    if n >= piece_bytes:
                        break
                    chunk = src.read(min(CHUNK, piece_bytes - n))
            pieces.append({"name": name, "size": n, "sha256": h.hexdigest()})
            if echo:
                echo(f"{outdir / name}  {n} bytes  sha256 {h.hexdigest()}")
    manifest = {
        "name": path.name,
        "size": sum(p["size"] for p in pieces),
        "sha256": whole.hexdigest(),
        "piece_bytes": piece_bytes,
        "pieces": pieces,
    }
    out = outdir / f"{path.name}{MANIFEST_SUFFIX}"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out)
    return out


def _load(manifest) -> dict:
    manifest = Path(manifest)
    try:
        data = json.loads(manifest.read_text())
        name, size, digest, pieces = data["name"], data["size"], data["sha256"], data["pieces"]
        for p in pieces:
            p["name"], p["size"], p["sha256"]  # noqa: B018  (each piece has its three fields)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CarryError(f"{manifest}: not a readable carry manifest ({type(e).__name__}: {e})") from None
    for n in [name] + [p["name"] for p in pieces]:
        if not isinstance(n, str) or not n or Path(n).name != n or n in (".", ".."):
            raise CarryError(f"{manifest}: bad file name {n!r} in manifest")
    if sum(p["size"] for p in pieces) != size:
        raise CarryError(f"{manifest}: piece sizes do not add up to the total size {size}")
    return data


def _dirs(manifest, piece_dirs) -> list[Path]:
    dirs = [Path(manifest).parent] + [Path(d) for d in piece_dirs or []]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def _examine(piece: dict, dirs: list[Path], hash_it: bool = True) -> tuple[str, Path | None, str]:
    """('valid' | 'bad' | 'missing', path, why) for one piece; a valid copy in any folder wins."""
    first_bad = None
    for d in dirs:
        p = d / piece["name"]
        if not p.is_file():
            continue
        got = p.stat().st_size
        if got != piece["size"]:
            why = f"piece {piece['name']} has {got} bytes, manifest says {piece['size']} ({p})"
        elif hash_it and _sha256(p) != piece["sha256"]:
            why = f"piece {piece['name']} sha256 differs from the manifest ({p})"
        else:
            return "valid", p, ""
        first_bad = first_bad or (p, why)
    if first_bad:
        return "bad", first_bad[0], first_bad[1]
    return "missing", None, f"piece {piece['name']} missing (looked in {', '.join(map(str, dirs))})"


def missing(manifest, piece_dirs=()) -> list[str]:
    """Names of the pieces with no valid copy (absent, wrong size or wrong sha256): the ones still to send."""
    data, dirs = _load(manifest), _dirs(manifest, piece_dirs)
    return [p["name"] for p in data["pieces"] if _examine(p, dirs)[0] != "valid"]


def join(manifest, piece_dirs=(), out=None) -> Path:
    """Reassemble the file the manifest describes; returns its path. Raises CarryError, leaving nothing behind."""
    data, dirs = _load(manifest), _dirs(manifest, piece_dirs)
    out = Path(out) if out is not None else Path(manifest).parent / data["name"]
    # Presence and sizes first (cheap), then checksums, all before anything is written.
    for piece in data["pieces"]:
        state, _, why = _examine(piece, dirs, hash_it=False)
        if state != "valid":
            raise CarryError(why)
    found = []
    for piece in data["pieces"]:
        state, path, why = _examine(piece, dirs)
        if state != "valid":
            raise CarryError(why)
        found.append(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.carry-tmp")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for piece, path in zip(data["pieces"], found):
                h = hashlib.sha256()
                with open(path, "rb") as src:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                if h.hexdigest() != piece["sha256"]:
                    raise CarryError(f"piece {piece['name']} changed while being joined ({path})")
            dst.flush()
            os.fsync(dst.fileno())
        if whole.hexdigest() != data["sha256"]:
            raise CarryError(f"joined file's sha256 differs from the manifest's {data['sha256']}")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out.parent)
    return out


def pack(files, outdir, load_bytes: int, piece_bytes: int = 14 << 20, echo=None) -> list[Path]:
    """Lay `files` out as numbered load folders of at most `load_bytes` each; returns the folders in order."""
    outdir = Path(outdir)
    if piece_bytes > load_bytes:
        raise CarryError(f"a piece ({piece_bytes} bytes) must fit in a load ({load_bytes} bytes)")
    if outdir.exists() and any(outdir.iterdir()):
        raise CarryError(f"{outdir} is not empty: pack into a new folder")
    files = [Path(f) for f in files]
    for f in files:  # all checked before anything is written
        if not f.is_file():
            raise CarryError(f"{f}: no such file")
    stage = outdir / ".stage"
    items = []  # (path, size, manifest riding with it or None), in travel order
    for f in files:
        if f.stat().st_size <= piece_bytes:
            items.append((f, f.stat().st_size, None))
            continue
        manifest = split(f, stage, piece_bytes)
        pieces = _load(manifest)["pieces"]
        for i, piece in enumerate(pieces):
            items.append((stage / piece["name"], piece["size"], manifest if i == len(pieces) - 1 else None))
    loads, used = [], load_bytes + 1
    for path, size, manifest in items:
        extra = manifest.stat().st_size if manifest else 0
        if used + size + extra > load_bytes:
            loads.append(outdir / f"{len(loads):02d}")
            loads[-1].mkdir(parents=True)
            used = 0
        (os.replace if path.parent == stage else shutil.copy2)(path, loads[-1] / path.name)
        if manifest:
            os.replace(manifest, loads[-1] / manifest.name)
        used += size + extra
    shutil.rmtree(stage, ignore_errors=True)
    if echo:
        for load in loads:
            echo(f"{load}  {sum(f.stat().st_size for f in load.iterdir()) / (1 << 20):.1f} MiB  "
                 f"{len(list(load.iterdir()))} files")
    return loads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="carry.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut FILE into pieces and a manifest in OUTDIR")
    s.add_argument("file")
    s.add_argument("outdir")
    s.add_argument("--piece-mib", type=float, default=15, help="piece size in MiB (default 15)")
    for name in ("join", "check"):
        p = sub.add_parser(name, help="reassemble the file" if name == "join" else "list valid/bad/missing pieces")
        p.add_argument("manifest")
        p.add_argument("--pieces", nargs="+", action="extend", default=[], metavar="DIR",
                       help="more folders holding pieces (the manifest's folder is always searched)")
        if name == "join":
            p.add_argument("--out", help="output path (default: the manifest's folder / the file's name)")
    k = sub.add_parser("pack", help="lay FILEs out as numbered loads in OUTDIR")
    k.add_argument("outdir")
    k.add_argument("files", nargs="+")
    k.add_argument("--load-mib", type=float, default=56, help="one load's size in MiB (default 56)")
    k.add_argument("--piece-mib", type=float, default=14, help="piece size in MiB (default 14)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            m = split(args.file, args.outdir, round(args.piece_mib * (1 << 20)), echo=print)
            print(f"manifest {m}")
        elif args.cmd == "pack":
            pack(args.files, args.outdir, round(args.load_mib * (1 << 20)), round(args.piece_mib * (1 << 20)),
                 echo=print)
        elif args.cmd == "join":
            out = join(args.manifest, args.pieces, args.out)
            print(f"{out}  sha256 {_load(args.manifest)['sha256']}")
        else:
            data, dirs = _load(args.manifest), _dirs(args.manifest, args.pieces)
            bad = 0
            for piece in data["pieces"]:
                state, path, why = _examine(piece, dirs)
                bad += state != "valid"
                print(f"{piece['name']}  {state}  {why or path}")
            print(f"{len(data['pieces']) - bad}/{len(data['pieces'])} pieces valid for {data['name']}")
            return 0 if bad == 0 else 1
    except (CarryError, OSError) as e:
        print(f"carry: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
