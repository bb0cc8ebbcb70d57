"""Faults of the on-disk prefix cache (`--prompt-cache-dir`): writers killed mid-write, damaged files, a full disk
and a folder that cannot be written. Nothing damaged is ever loaded, every loaded entry is exact, each fault is one
log line, and requests are served throughout."""

import errno
import logging
import os
import random
import subprocess
import sys
import threading
import queue
from pathlib import Path

import httpx
import numpy as np
import pytest

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server import prefix_store
from dflash_mlx.server.prefix_store import PREFIX, SUFFIX, PrefixStore
from prefix_store_writer import IDS, arrays_of, entry, key_of

HERE = Path(__file__).resolve().parent
KILLS = 24


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _files(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def _assert_exact(store: PrefixStore, stored) -> None:
    snap = store.load(stored)
    assert snap is not None, f"{stored.path.name} was rejected: a kill must never damage a file"
    entry_id, version = stored.key[0], stored.key[1]
    assert list(stored.key) == key_of(entry_id, version)
    for cache, (keys, values) in zip(snap.target, arrays_of(entry_id, version)):
        assert np.array_equal(np.array(cache.keys[..., : cache.offset, :]), keys)
        assert np.array_equal(np.array(cache.values[..., : cache.offset, :]), values)


def test_writers_killed_at_random_moments_leave_no_damaged_entry(tmp_path):
    """`kill -9` a writer KILLS times at random moments of its stream of writes (each rewriting an entry and
    evicting others to keep the budget); after each, a restarted store loads every entry it lists, exactly."""
    budget = 5 * entry(0, 0)[1].nbytes  # fewer than IDS entries fit: writes also delete
    writer = subprocess.Popen([sys.executable, str(HERE / "prefix_store_writer.py"), str(tmp_path), str(budget)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE.parent,
                              env=dict(os.environ, OBJC_DISABLE_INITIALIZE_FORK_SAFETY="YES"))  # macOS: it forks
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in writer.stdout], daemon=True).start()

    def expect(prefix: str, timeout: float = 120) -> str:
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the writer printed no '{prefix}' line within {timeout} s") from None
            if line.startswith(prefix):
                return line

    rng = random.Random(46)
    loaded = 0
    try:
        expect("ready", timeout=600)  # its imports, once, on a machine that may be busy
        for round_ in range(KILLS):
            # After the child's first whole entry, a random moment of the writes that follow.
            writer.stdin.write(f"go {round_} {rng.uniform(0.0, 0.08):.4f}\n")
            writer.stdin.flush()
            _, saved, status = expect("done").split()
            assert saved == "1" and os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == 9, \
                f"the writer died by itself (wait status {status})"
            store = PrefixStore(tmp_path, "writer-pair", budget)
            assert store.entries and len(store.entries) <= IDS
            for stored in list(store.entries.values()):
                _assert_exact(store, stored)
                loaded += 1
            # No temporary file of a dead writer is left, and every file of ours is a listed entry.
            assert sorted(p.name for p in tmp_path.glob(f"{PREFIX}*{SUFFIX}")) == \
                sorted(s.path.name for s in store.entries.values())
            assert not list(tmp_path.glob(".*tmp*"))
    finally:
        writer.kill()
        writer.wait()
    assert loaded >= KILLS


def test_a_cut_short_file_is_removed_at_start_with_one_line(tmp_path, caplog):
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    for i in range(3):
        store.save(*entry(i, 0))
    paths = sorted(tmp_path.glob(f"{PREFIX}*{SUFFIX}"))
    for path in paths[:2]:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # the header survives, the tensors do not
    caplog.set_level(logging.WARNING, "dflash_mlx")
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    assert [s.path for s in store.entries.values()] == [paths[2]]
    assert not paths[0].exists() and not paths[1].exists()
    (line,) = _warnings(caplog)
    assert "removed 2 damaged" in line


def test_a_damaged_byte_is_caught_by_the_checksum(tmp_path, caplog):
    """Same size, header intact, one byte of a tensor changed: the checksum in the name catches it on load."""
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    key, snap = entry(1, 0)
    store.save(key, snap)
    (path,) = tmp_path.glob(f"{PREFIX}*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, "dflash_mlx")
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    length, stored = store.best(key + [1], len(key))
    assert length == len(key)
    assert store.load(stored) is None and store.entries == {} and not path.exists()
    (line,) = _warnings(caplog)
    assert path.name in line and "checksum" in line
    assert store.best(key + [1], len(key)) == (0, None)


def test_a_rewrite_cut_off_before_removing_the_old_file_keeps_the_newer(tmp_path):
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    key, old = entry(2, 0)
    store.save(key, old)
    (first,) = tmp_path.glob(f"{PREFIX}*{SUFFIX}")
    kept = first.read_bytes()
    store.save(key, entry(2, 1)[1])  # same key, other values: a new file replaces the old one
    (second,) = tmp_path.glob(f"{PREFIX}*{SUFFIX}")
    assert second != first
    first.write_bytes(kept)  # as if the writer died between the rename and the removal
    os.utime(first, ns=(1, 1))
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    assert [s.path for s in store.entries.values()] == [second] and not first.exists()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_one_line_until_writes_succeed_again(tmp_path, caplog, monkeypatch):
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    caplog.set_level(logging.WARNING, "dflash_mlx")
    monkeypatch.setattr(prefix_store, "save_prompt_cache", _no_space)
    for i in range(4):
        store.save(*entry(i, 0))
    assert store.entries == {} and _files(tmp_path) == []  # no temporary file left behind either
    (line,) = _warnings(caplog)
    assert "No space left" in line and "still served" in line
    monkeypatch.undo()
    store.save(*entry(5, 0))
    assert len(store.entries) == 1 and "takes writes again" in _warnings(caplog)[-1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("faults"))
    return load(str(target_dir), str(drafter_dir))


def _serve_twice(pair, settings, prompts):
    """Each prompt's reply from a server with `settings`, asked twice (the second may be served from a cache)."""
    running = start_in_thread(create_app(*pair, settings))
    try:
        replies = []
        for ids in prompts + prompts:
            r = httpx.post(running.base + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["text"])
        return replies
    finally:
        running.stop()


PROMPTS = [[(7 * i + j) % 90 + 3 for i in range(40)] for j in range(3)]


def test_a_server_on_a_full_disk_serves_every_request(pair, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "dflash_mlx")
    alone = _serve_twice(pair, ServerSettings(model_name="tiny", prompt_cache_bytes=0), PROMPTS)
    monkeypatch.setattr(prefix_store, "save_prompt_cache", _no_space)
    # Every entry is written as the server stops: each write fails, the first one says so.
    settings = ServerSettings(model_name="tiny", prompt_cache_dir=str(tmp_path))
    assert _serve_twice(pair, settings, PROMPTS) == alone
    assert len([w for w in _warnings(caplog) if "could not write" in w]) == 1
    assert _files(tmp_path) == []


def test_a_folder_that_cannot_be_created_is_one_line_and_the_server_serves(pair, tmp_path, caplog):
    """A folder under a file can be made by nobody, root included (chmod does not stop root)."""
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    caplog.set_level(logging.WARNING, "dflash_mlx")
    alone = _serve_twice(pair, ServerSettings(model_name="tiny", prompt_cache_bytes=0), PROMPTS)
    settings = ServerSettings(model_name="tiny", prompt_cache_dir=str(blocker / "cache"))
    assert _serve_twice(pair, settings, PROMPTS) == alone
    (line,) = _warnings(caplog)
    assert "cannot be written" in line and str(blocker / "cache") in line
    assert blocker.read_text() == "mine"


def test_a_read_only_folder_is_read_and_never_written(tmp_path, caplog, monkeypatch):
    """A folder of entries that turned read-only: one line at start, its entries still load, nothing is written
    or removed. Root writes through chmod, so as root the refusal is the kernel's answer for a read-only mount
    (EROFS), given to every file created in the folder."""
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    key, snap = entry(3, 0)
    store.save(key, snap)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    if os.geteuid() == 0:
        real_open = os.open

        def read_only(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and Path(path).parent == tmp_path:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    else:
        tmp_path.chmod(0o555)
    try:
        caplog.set_level(logging.WARNING, "dflash_mlx")
        store = PrefixStore(tmp_path, "pair", 1 << 30)
        (line,) = _warnings(caplog)
        assert "cannot be written" in line and "1 entries are still read" in line
        assert store.load(store.best(key + [0], len(key))[1]) is not None
        store.save(*entry(4, 0))
        store.max_bytes = 1
        store._keep_budget(keep=())
    finally:
        tmp_path.chmod(0o755)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_an_entry_named_the_old_way_is_adopted_with_its_checksum(tmp_path):
    """Entries written before names carried a checksum are renamed to carry one and load as before; another
    pair's are left as they are."""
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    key, snap = entry(2, 7)
    store.save(key, snap)
    (path,) = tmp_path.glob(f"{PREFIX}*{SUFFIX}")
    old = path.with_name(path.name[: len(PREFIX) + 40] + SUFFIX)
    path.rename(old)
    PrefixStore(tmp_path, "other-pair", 1 << 30)
    assert _files(tmp_path) == [old.name]
    store = PrefixStore(tmp_path, "pair", 1 << 30)
    assert _files(tmp_path) == [path.name]
    _assert_exact(store, store.entries[tuple(key)])
