"""A new user's mistakes with the newer options, one row each: draft trees (`--tree-budget`), MTP drafting on a target
without MTP layers, the prefill chunk, the agent launchers (a client not installed, bad options, a server that is
not there, a mistyped model) and the agent-session benchmark (no such folder, a damaged recording). Each ends in
one `error:` line that says what to do, a non-zero exit, and nothing of the user's changed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair3"))


def _run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err, prefix="error: "):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("value", ["-3", "0", "lots", "1.5", ""])
def test_a_bad_tree_budget_is_one_line(pair, capsys, value):
    target, drafter = pair
    code, out, err = _run(capsys, "generate", "--model", target, "--draft", drafter, "--prompt", "hi",
                          "--tree-budget", value)
    line = _one_line(err)
    assert code == 2 and "--tree-budget" in line and "'auto' or 'off'" in line and not out


def test_a_bad_tree_budget_in_a_bench_list_is_one_line(pair, capsys, tmp_path):
    target, drafter = pair
    code, _, err = _run(capsys, "bench", "--model", target, "--draft", drafter, "--tree-budget", "4,x")
    assert code == 2 and "got 'x'" in _one_line(err)


def test_mtp_on_a_target_without_mtp_layers_is_one_line(pair, capsys):
    target, _ = pair
    before = sorted(p.name for p in Path(target).iterdir())
    code, _, err = _run(capsys, "generate", "--model", target, "--draft", "mtp", "--prompt", "hi")
    line = _one_line(err)
    assert code == 2 and "has no MTP layers" in line and "--draft lookup" in line
    assert sorted(p.name for p in Path(target).iterdir()) == before


def test_a_mistyped_model_is_named_before_the_missing_drafter(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", tmp_path / "no-such-model", "--prompt", "hi")
    line = _one_line(err)
    assert code == 2 and "not found" in line and "no-such-model" in line


def test_a_prefill_step_of_zero_is_one_line(capsys):
    code, _, err = _run(capsys, "serve", "--prefill-step-size", "0")
    assert code == 2 and "--prefill-step-size" in _one_line(err)


# -- the launchers -------------------------------------------------------------------------------------------------
@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A `claude` on an otherwise empty PATH that records that it ran (it must not, for any row here)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "claude"
    script.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.mark.parametrize("command", ["claude", "codex"])
def test_a_launcher_without_its_client_is_one_line(capsys, tmp_path, monkeypatch, command):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = _run(capsys, command, "--prompt-cache-dir-bytes", "lots", "--bogus-client-flag")
    assert code == 2 and "npm install -g" in _one_line(err)  # the first thing to fix, before anything loads


def test_a_launcher_s_bad_disk_budget_is_one_line(stand_in, capsys):
    code, out, err = _run(capsys, "claude", "--prompt-cache-dir-bytes", "lots", "-p", "hi")
    assert code == 2 and "--prompt-cache-dir-bytes 'lots' is not a size" in _one_line(err)
    assert not (stand_in / "ran").exists() and "loading" not in out


def test_a_launcher_s_cache_folder_that_is_a_file_is_one_line(stand_in, capsys):
    mine = stand_in / "notes.txt"
    mine.write_text("mine")
    code, _, err = _run(capsys, "claude", "--prompt-cache-dir", mine, "-p", "hi")
    assert code == 2 and "is a file" in _one_line(err)
    assert mine.read_text() == "mine" and not (stand_in / "ran").exists()


def test_a_launcher_pointed_at_no_server_is_one_line(stand_in, capsys):
    code, _, err = _run(capsys, "claude", "--url", "http://127.0.0.1:9", "-p", "hi")
    line = _one_line(err)
    assert code == 2 and "no dflash-mlx server answers" in line and "leave out --url" in line
    assert not (stand_in / "ran").exists()


def test_a_launcher_with_a_mistyped_model_is_one_line(stand_in, capsys):
    code, _, err = _run(capsys, "claude", "--model", stand_in / "no-such-model", "-p", "hi")
    assert code == 2 and "not found" in _one_line(err)
    assert not (stand_in / "ran").exists() and not (stand_in / "home").exists()  # no cache folder made for it


# -- the agent-session benchmark -----------------------------------------------------------------------------------
def _session(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "agent_session.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_agent_session_without_its_folder_is_one_line(tmp_path):
    done = _session(tmp_path / "no-such-session", "--model", "unused")
    assert done.returncode != 0 and "no such session folder" in _one_line(done.stderr)


def test_agent_session_with_a_damaged_recording_is_one_line(tmp_path):
    (tmp_path / "001_POST_v1_messages.json").write_text(json.dumps({"method": "POST", "path": "/v1/messages",
                                                                    "body": {"model": "m"}}))
    damaged = tmp_path / "002_POST_v1_messages.json"
    damaged.write_text('{"method": "POST", "path": "/v1/mess')
    done = _session(tmp_path, "--model", "unused")
    line = _one_line(done.stderr)
    assert done.returncode != 0 and str(damaged) in line and "not a recorded request" in line
    assert damaged.read_text() == '{"method": "POST", "path": "/v1/mess'
    assert sorted(os.listdir(tmp_path)) == ["001_POST_v1_messages.json", "002_POST_v1_messages.json"]


def test_agent_session_with_nothing_to_replay_is_one_line(tmp_path):
    (tmp_path / "001_GET_v1_models.json").write_text(json.dumps({"method": "GET", "path": "/v1/models"}))
    done = _session(tmp_path, "--model", "unused")
    assert done.returncode != 0 and "no recorded generation requests" in _one_line(done.stderr)
