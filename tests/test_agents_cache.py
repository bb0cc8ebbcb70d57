"""The launchers keep an agent's prefix cache between sessions: the client's model ids are pinned to the served
name (Claude Code writes the id into its system prompt, and picks another one on --continue than in a new
session), and the server they start keeps its prefix cache on disk, per model, under the package's cache folder,
so a second session's first request is read from the cache. A stand-in `claude` on PATH replays Claude Code's
recorded first request (tests/fixtures/agents) the way Claude Code composes it."""

import json
import os
from pathlib import Path

from dflash_mlx.agents import CLAUDE_MODEL_VARIABLES, claude_environment, codex_arguments, default_cache_dir
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server.prefix_store import PREFIX, SUFFIX

FIXTURE = Path(__file__).parent / "fixtures" / "agents" / "claude-code-2.1.197-first-request.json"

# Claude Code as far as the prompt goes: its model id (ANTHROPIC_MODEL, else its own, which differs between a new
# session and --continue) in its system prompt; --continue sends the conversation so far and a new question.
STAND_IN = '''#!/usr/bin/env python3
import json, os, sys, urllib.request
body = json.load(open(os.environ["STAND_IN_BODY"]))
resumed = "--continue" in sys.argv
model = os.environ.get("ANTHROPIC_MODEL") or ("claude-opus-4-8" if resumed else "claude-opus-4-8[1m]")
body["model"] = model
body["system"][0]["text"] = f"You are powered by the model {model}. " + body["system"][0]["text"]
if resumed:
    body["messages"] += [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Now say bye"}]
request = urllib.request.Request(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "anthropic-version": "2023-06-01",
                                          "x-api-key": os.environ["ANTHROPIC_AUTH_TOKEN"]})
print(json.dumps(json.load(urllib.request.urlopen(request, timeout=600))["usage"]))
'''


def _shortened(value, limit=1500):
    if isinstance(value, dict):
        return {k: _shortened(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_shortened(v, limit) for v in value]
    return value[:limit] if isinstance(value, str) else value


def test_claude_code_s_model_ids_are_pinned_to_the_served_name():
    env = claude_environment("http://127.0.0.1:1", None, {"HOME": "/h"}, "qwen-coder")
    assert all(env[v] == "qwen-coder" for v in CLAUDE_MODEL_VARIABLES)
    # The user's own choice stands (it is the same in every session too).
    env = claude_environment("http://127.0.0.1:1", None, {"ANTHROPIC_MODEL": "mine"}, "qwen-coder")
    assert env["ANTHROPIC_MODEL"] == "mine" and env["ANTHROPIC_SMALL_FAST_MODEL"] == "qwen-coder"
    args = codex_arguments("http://127.0.0.1:1", "qwen-coder", None)
    assert "model=\"qwen-coder\"" in args


def test_each_pair_has_its_own_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    a = default_cache_dir("mlx-community/Qwen3-4B-4bit", None)
    assert a.parent == tmp_path / "prompt-cache" and "Qwen3-4B-4bit-" in a.name
    assert a == default_cache_dir("mlx-community/Qwen3-4B-4bit", None)
    assert a != default_cache_dir("mlx-community/Qwen3-4B-4bit", "z-lab/Qwen3-4B-DFlash-b16")
    assert default_cache_dir("/models/a/", None).name.startswith("models-a-")


def test_a_second_session_starts_warm(tmp_path, monkeypatch, capfd):
    from dflash_mlx.cli import main

    target_dir, drafter_dir = make_tiny_pair(tmp_path / "pair")
    (tmp_path / "bin").mkdir()
    client = tmp_path / "bin" / "claude"
    client.write_text(STAND_IN)
    client.chmod(0o755)
    body = _shortened(json.loads(FIXTURE.read_text())["body"])
    body.update(stream=False, max_tokens=4)
    (tmp_path / "body.json").write_text(json.dumps(body))
    monkeypatch.setenv("STAND_IN_BODY", str(tmp_path / "body.json"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    for variable in CLAUDE_MODEL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    options = ["--model", str(target_dir), "--draft", str(drafter_dir)]

    usages = []
    for session in (["-p", "Say hi"], ["--continue", "-p", "Now say bye"]):
        assert main(["claude", *options, *session]) == 0
        usages.append(json.loads(capfd.readouterr().out.strip().splitlines()[-1]))
    first, second = usages
    assert first["cache_read_input_tokens"] == 0  # each session starts its own server
    read = second["cache_read_input_tokens"] / (second["cache_read_input_tokens"] + second["input_tokens"])
    print(f"second session read {read:.1%} of its first request from the cache: {usages}")
    assert read >= 0.9, usages
    assert list(default_cache_dir(str(target_dir), str(drafter_dir)).glob(f"{PREFIX}*{SUFFIX}"))
