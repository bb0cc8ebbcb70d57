"""`dflash-mlx claude` and `dflash-mlx codex`: run a coding agent against a local server, configured for that one
process only.

A launcher starts `dflash-mlx serve`'s app on a free loopback port for the chosen pair (or uses the server given
by `--url`), then runs the client with its settings in the child's environment and command line: nothing is
written into the user's `~/.claude` or `~/.codex`. The client's own arguments pass through unchanged.

Claude Code: `ANTHROPIC_BASE_URL` (the server, no /v1), a placeholder token, no telemetry, and no idle or request
time-outs (`API_FORCE_IDLE_TIMEOUT=0`, `API_TIMEOUT_MS`): a long prompt's prefill on a CPU outlasts its defaults.
Its own model ids (claude-opus-..., a haiku id for side tasks) are served by the one model.
Codex: `-c` overrides for a `dflash` model provider (Responses API, `stream_idle_timeout_ms`), the served model's
name and context window.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .errors import DFlashError

NO_TIMEOUT_MS = 24 * 3600 * 1000  # a day: "no time-out" for clients that want a number
API_KEY = "dflash-mlx"  # clients insist on some key; the server checks one only with --api-key


@dataclass(frozen=True)
class Client:
    command: str  # the executable on PATH
    title: str
    package: str  # npm package

    def find(self) -> str:
        path = shutil.which(self.command)
        if path is None:
            raise DFlashError(f"{self.title} is not installed (no '{self.command}' on PATH): install it with "
                              f"'npm install -g {self.package}', then run this again")
        return path


CLAUDE = Client("claude", "Claude Code", "@anthropic-ai/claude-code")
CODEX = Client("codex", "Codex", "@openai/codex")


def claude_environment(base: str, api_key: Optional[str], environ: Dict[str, str]) -> Dict[str, str]:
    """Claude Code's environment for a server at `base` (http://HOST:PORT)."""
    env = {k: v for k, v in environ.items() if k != "ANTHROPIC_API_KEY"}  # never sent to a local server
    env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_AUTH_TOKEN=api_key or API_KEY,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
               API_FORCE_IDLE_TIMEOUT="0", API_TIMEOUT_MS=str(NO_TIMEOUT_MS))
    return env


def codex_arguments(base: str, model: str, context: Optional[int]) -> List[str]:
    """Codex's `-c` overrides for a server at `base` serving `model`."""
    provider = "model_providers.dflash"
    overrides = [f"model_provider={json.dumps('dflash')}", f"model={json.dumps(model)}",
                 f"{provider}.name={json.dumps('dflash-mlx')}", f"{provider}.base_url={json.dumps(base + '/v1')}",
                 f"{provider}.wire_api={json.dumps('responses')}", f"{provider}.env_key={json.dumps('DFLASH_MLX_API_KEY')}",
                 f"{provider}.stream_idle_timeout_ms={NO_TIMEOUT_MS}",
                 "check_for_update_on_startup=false"]
    if context:
        overrides.append(f"model_context_window={context}")
    return [arg for override in overrides for arg in ("-c", override)]


def served_model(base: str, api_key: Optional[str]) -> Tuple[str, Optional[int]]:
    """The first model a running server lists, and its context length (None when it does not say)."""
    request = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {api_key or API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            models = json.load(reply).get("data") or []
    except (OSError, ValueError) as e:
        raise DFlashError(f"no dflash-mlx server answers at {base} ({e}): start one with 'dflash-mlx serve', or "
                          "leave out --url to start one for this session") from None
    if not models:
        raise DFlashError(f"the server at {base} lists no model")
    return models[0]["id"], models[0].get("context_length")


def run_client(argv: List[str], env: Dict[str, str]) -> int:
    """Run the client in the foreground; Ctrl-C is the client's to handle, not ours."""
    child = subprocess.Popen(argv, env=env)  # started first: an ignored SIGINT would carry over into it
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def launch(client: Client, args: List[str], *, model: str, draft: Optional[str], quant: Optional[str],
           url: Optional[str], api_key: Optional[str], max_batch: int = 8) -> int:
    """Start a server for the pair (or use `url`), run the client against it, stop the server; the client's
    exit status."""
    executable = client.find()  # before minutes of model loading
    running = None
    if url is None:
        from .api import load
        from .server import ServerSettings, create_app, start_in_thread

        print(f"dflash-mlx: loading {model} for {client.title}...", flush=True)
        settings = ServerSettings(api_key=api_key, max_batch=max_batch).name_after(model, draft)
        target, tokenizer, drafter = load(model, draft, quant=quant)
        running = start_in_thread(create_app(target, tokenizer, drafter, settings))
        base = running.base
        print(f"dflash-mlx: serving {settings.model_name} at {base}", flush=True)
    else:
        base = url.rstrip("/").removesuffix("/v1")
    try:
        name, context = served_model(base, api_key)
        if client is CLAUDE:
            return run_client([executable, *args], claude_environment(base, api_key, dict(os.environ)))
        env = dict(os.environ, DFLASH_MLX_API_KEY=api_key or API_KEY)
        return run_client([executable, *codex_arguments(base, name, context), *args], env)
    finally:
        if running is not None:
            running.stop()
