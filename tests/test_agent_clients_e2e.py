"""The real coding agents end to end (slow): Claude Code 2.1 and Codex 0.171, installed from npm into a folder of
this run (or found on PATH, or in $DFLASH_AGENT_CLIENTS/bin), run through `dflash-mlx claude` / `dflash-mlx codex`
against the demo pair behind a recording proxy (tests/agents/recorder.py); every answer they got must be a 2xx.
Offline: the clients talk to loopback only, with telemetry off and a throwaway HOME / CODEX_HOME.

    python -m pytest -m slow tests/test_agent_clients_e2e.py
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx import load
from dflash_mlx.demo import AGENT_CONTEXT, make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

sys.path.insert(0, str(Path(__file__).parent / "agents"))
from recorder import make_app  # noqa: E402

pytestmark = pytest.mark.slow
PACKAGES = ["@anthropic-ai/claude-code@2.1", "@openai/codex@0.171"]


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """A folder whose bin/ holds `claude` and `codex`."""
    given = os.environ.get("DFLASH_AGENT_CLIENTS")
    if given and (Path(given) / "bin" / "claude").exists():
        return Path(given) / "bin"
    if shutil.which("claude") and shutil.which("codex"):
        return Path(shutil.which("claude")).parent
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the agent clients come from npm")
    prefix = tmp_path_factory.mktemp("agent-clients")
    done = subprocess.run(["npm", "install", "-g", "--prefix", str(prefix), *PACKAGES], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"npm could not install the clients: {done.stderr[-300:]}")
    return prefix / "bin"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo pair served (replies capped: random weights never stop), behind a recording proxy."""
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("agent-demo"), context=AGENT_CONTEXT)
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    server = start_in_thread(create_app(model, tokenizer, drafter,
                                        ServerSettings(model_name="demo", default_max_tokens=16)))
    records = tmp_path_factory.mktemp("recorded")
    proxy = start_in_thread(make_app(server.base, records))
    yield proxy.base, records
    proxy.stop()
    server.stop()


def _statuses(records: Path):
    return [(json.loads(p.read_text())["path"], json.loads(p.read_text())["status"]) for p in sorted(records.glob("*"))]


def _launch(agent, url, args, clients, home, extra_env):
    env = dict(os.environ, PATH=f"{clients}{os.pathsep}{os.environ['PATH']}", HOME=str(home), **extra_env)
    return subprocess.run([sys.executable, "-m", "dflash_mlx.cli", agent, "--url", url, *args], env=env,
                          capture_output=True, text=True, timeout=900, cwd=home, stdin=subprocess.DEVNULL)


def test_claude_code_gets_only_2xx(served, clients, tmp_path):
    url, records = served
    done = _launch("claude", url, ["-p", "Say hi", "--output-format", "json"], clients, tmp_path,
                   {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16"})
    statuses = _statuses(records)
    assert any(path == "/v1/messages" for path, _ in statuses), (done.stdout, done.stderr)
    assert all(200 <= status < 300 for _, status in statuses), statuses
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "api_error_status" not in result or result["api_error_status"] is None, result


@pytest.mark.parametrize("model", ["gpt-5-codex", "gpt-5.5", "demo"])
def test_codex_gets_only_2xx(served, clients, tmp_path, model):
    url, records = served
    for old in records.glob("*"):
        old.unlink()
    home = tmp_path / "home"
    home.mkdir()
    done = _launch("codex", url, ["exec", "-m", model, "--skip-git-repo-check", "Say hi"], clients, home,
                   {"CODEX_HOME": str(home)})
    statuses = _statuses(records)
    assert any(path == "/v1/responses" for path, _ in statuses), (done.stdout, done.stderr)
    assert all(200 <= status < 300 for _, status in statuses), statuses
