"""benchmarks/carry.py: split a file into checked pieces and join them back, refusing bad or missing pieces."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "carry.py"
_spec = importlib.util.spec_from_file_location("carry", SCRIPT)
carry = sys.modules["carry"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry)

PIECE = 1000


def _file(tmp_path, size, name="target.gguf"):
    path = tmp_path / "src" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def _pieces(manifest):
    return json.loads(Path(manifest).read_text())["pieces"]


@pytest.mark.parametrize("size", [5500, 5000, 1, 0])
def test_round_trip(tmp_path, size):
    src = _file(tmp_path, size)
    manifest = carry.split(src, tmp_path / "out", PIECE)
    data = json.loads(manifest.read_text())
    assert manifest.name == "target.gguf.manifest.json"
    assert data["name"] == "target.gguf" and data["size"] == size
    assert data["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert len(data["pieces"]) == -(-size // PIECE)  # exact boundary: no empty trailing piece; empty file: none
    assert [p["name"] for p in data["pieces"]] == [f"target.gguf.part{i:03d}" for i in range(len(data["pieces"]))]
    for p in data["pieces"]:
        piece = tmp_path / "out" / p["name"]
        assert 0 < p["size"] <= PIECE and piece.stat().st_size == p["size"]
        assert hashlib.sha256(piece.read_bytes()).hexdigest() == p["sha256"]
    assert carry.missing(manifest, []) == []
    out = carry.join(manifest, [], tmp_path / "back" / "target.gguf")
    assert out.read_bytes() == src.read_bytes()
    assert sorted(x.name for x in out.parent.iterdir()) == ["target.gguf"]  # no temp file left


def test_default_out_and_two_folders(tmp_path):
    src = _file(tmp_path, 5500)
    manifest = carry.split(src, tmp_path / "a", PIECE)
    other = tmp_path / "b"
    other.mkdir()
    for p in _pieces(manifest)[::2]:  # half the pieces arrived in another command's folder
        shutil.move(tmp_path / "a" / p["name"], other / p["name"])
    assert carry.missing(manifest, []) == [p["name"] for p in _pieces(manifest)[::2]]
    assert carry.missing(manifest, [other]) == []
    out = carry.join(manifest, [other])
    assert out == tmp_path / "a" / "target.gguf"
    assert out.read_bytes() == src.read_bytes()


def test_missing_piece(tmp_path):
    manifest = carry.split(_file(tmp_path, 5500), tmp_path / "out", PIECE)
    (tmp_path / "out" / "target.gguf.part003").unlink()
    assert carry.missing(manifest, []) == ["target.gguf.part003"]
    with pytest.raises(carry.CarryError, match=r"target\.gguf\.part003 missing"):
        carry.join(manifest, [], tmp_path / "back" / "target.gguf")
    assert not (tmp_path / "back").exists()  # refused before anything was written


def test_corrupted_piece(tmp_path):
    manifest = carry.split(_file(tmp_path, 5500), tmp_path / "out", PIECE)
    piece = tmp_path / "out" / "target.gguf.part002"
    raw = bytearray(piece.read_bytes())
    raw[17] ^= 0x01
    piece.write_bytes(bytes(raw))
    assert carry.missing(manifest, []) == ["target.gguf.part002"]
    with pytest.raises(carry.CarryError, match=r"target\.gguf\.part002 sha256 differs"):
        carry.join(manifest, [], tmp_path / "back" / "target.gguf")
    assert not (tmp_path / "back" / "target.gguf").exists()
    # A good copy in another folder is used instead.
    good = tmp_path / "good"
    carry.split(tmp_path / "src" / "target.gguf", good, PIECE)
    out = carry.join(manifest, [good], tmp_path / "back" / "t")
    assert out.read_bytes() == (tmp_path / "src" / "target.gguf").read_bytes()


def test_truncated_piece(tmp_path):
    manifest = carry.split(_file(tmp_path, 5500), tmp_path / "out", PIECE)
    piece = tmp_path / "out" / "target.gguf.part001"
    piece.write_bytes(piece.read_bytes()[:-1])
    with pytest.raises(carry.CarryError, match=r"target\.gguf\.part001 has 999 bytes, manifest says 1000"):
        carry.join(manifest, [], tmp_path / "back" / "target.gguf")
    assert not (tmp_path / "back" / "target.gguf").exists()


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_cli(tmp_path):
    src = _file(tmp_path, 5500)
    r = _run("split", src, tmp_path / "out", "--piece-mib", PIECE / (1 << 20))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 6 + 1  # one line per piece, then the manifest
    manifest = tmp_path / "out" / "target.gguf.manifest.json"
    r = _run("check", manifest)
    assert r.returncode == 0 and "6/6 pieces valid" in r.stdout
    out = tmp_path / "back" / "t.gguf"
    r = _run("join", manifest, "--out", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == src.read_bytes()
    assert hashlib.sha256(src.read_bytes()).hexdigest() in r.stdout and str(out) in r.stdout

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(tmp_path / "out" / "target.gguf.part005", moved / "target.gguf.part005")
    r = _run("check", manifest)
    assert r.returncode == 1 and "target.gguf.part005  missing" in r.stdout
    r = _run("join", manifest, "--out", tmp_path / "x")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "target.gguf.part005" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
    r = _run("join", manifest, "--pieces", moved, "--out", tmp_path / "x")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "x").read_bytes() == src.read_bytes()


def test_pack_fills_loads_in_order_and_each_file_joins_from_its_loads(tmp_path):
    """Files larger than a piece are split across loads (manifest with the last piece), smaller ones travel whole,
    no load exceeds its size, and every file joins back from the loads it travelled in."""
    big = _file(tmp_path, 5500, "wheel.whl")
    small = _file(tmp_path, 300, "config.json")
    other = _file(tmp_path, 2100, "target.gguf")
    loads = carry.pack([big, small, other], tmp_path / "loads", load_bytes=3000, piece_bytes=PIECE)
    assert [d.name for d in loads] == [f"{i:02d}" for i in range(len(loads))]
    for d in loads:
        assert sum(f.stat().st_size for f in d.iterdir()) <= 3000
    names = [sorted(f.name for f in d.iterdir()) for d in loads]
    assert names[0][:2] == ["wheel.whl.part000", "wheel.whl.part001"]  # travel order kept
    where = {f.name: d for d in loads for f in d.iterdir()}
    assert where["wheel.whl.manifest.json"] == where["wheel.whl.part005"]  # rides with the last piece
    assert (where["config.json"] / "config.json").read_bytes() == small.read_bytes()
    for src in (big, other):
        manifest = where[src.name + ".manifest.json"] / (src.name + ".manifest.json")
        out = carry.join(manifest, loads, tmp_path / "back" / src.name)
        assert out.read_bytes() == src.read_bytes()
    assert not (tmp_path / "loads" / ".stage").exists()
    with pytest.raises(carry.CarryError, match="not empty"):
        carry.pack([small], tmp_path / "loads", load_bytes=3000, piece_bytes=PIECE)
