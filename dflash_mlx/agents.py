"""`dflash-mlx claude` and `dflash-mlx codex`: run a coding agent against a local server, configured for that one
process only.

A launcher starts `dflash-mlx serve`'s app on a free loopback port for the chosen pair (or uses the server given
by `--url`), then runs the client with its settings in the child's environment and command line: nothing is
written into the user's `~/.claude` or `~/.codex`. The client's own arguments pass through unchanged.

Claude Code: `ANTHROPIC_BASE_URL` (the server, no /v1), a placeholder token, no telemetry, and no idle or request
time-outs (`API_FORCE_IDLE_TIMEOUT=0`, `API_TIMEOUT_MS`): a long prompt's prefill on a CPU outlasts its defaults.
Its model ids are pinned to the served model's name (`ANTHROPIC_MODEL` and the per-tier ids, unless the user set
them): Claude Code writes the id into its system prompt and picks another one on `--continue` than in a new
session (`claude-opus-4-8[1m]`, `claude-opus-4-8`), which would make every resumed prompt miss the prefix cache.
Codex: `-c` overrides for a `dflash` model provider (Responses API, `stream_idle_timeout_ms`), the served model's
name (pinned the same way) and context window.

Keeping the cache between runs: a launcher's own server keeps its prefix cache on disk (`--prompt-cache-dir`), by
default in `prompt-cache/<model>` under the package's cache folder with a bounded budget, and writes every entry
there before it stops; the next session (a new one, or `--continue`) starts warm.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import DFlashError

NO_TIMEOUT_MS = 24 * 3600 * 1000  # a day: "no time-out" for clients that want a number
API_KEY = "dflash-mlx"  # clients insist on some key; the server checks one only with --api-key
# Claude Code's model ids: the main one, the small/fast one for side tasks, and the ids behind its tier aliases.
CLAUDE_MODEL_VARIABLES = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                          "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")
DISK_CACHE_BYTES = "8GiB"  # a launcher's default --prompt-cache-dir-bytes


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


def claude_environment(base: str, api_key: Optional[str], environ: Dict[str, str],
                       model: Optional[str] = None) -> Dict[str, str]:
    """Claude Code's environment for a server at `base` (http://HOST:PORT) serving `model`: its model ids pinned
    to `model` where the user has not set them, so its system prompt is the same in every session."""
    env = {k: v for k, v in environ.items() if k != "ANTHROPIC_API_KEY"}  # never sent to a local server
    env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_AUTH_TOKEN=api_key or API_KEY,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
               API_FORCE_IDLE_TIMEOUT="0", API_TIMEOUT_MS=str(NO_TIMEOUT_MS))
    if model:
        for variable in CLAUDE_MODEL_VARIABLES:
            if not env.get(variable):
                env[variable] = model
    return env


def default_cache_dir(model: str, draft: Optional[str]) -> Path:
    """`prompt-cache/<model>` under the package's cache folder: one folder per pair, its name readable and unique
    (the tail of the model's name or path, and a digest of model and drafter)."""
    from .models.offline import home

    ident = f"{model}\n{draft or ''}"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/\\")).strip("-.")[-48:] or "model"
    return home() / "prompt-cache" / f"{readable}-{hashlib.sha1(ident.encode()).hexdigest()[:8]}"


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
           url: Optional[str], api_key: Optional[str], max_batch: int = 8, prompt_cache_dir: Optional[str] = None,
           prompt_cache_dir_bytes: str = DISK_CACHE_BYTES) -> int:
    """Start a server for the pair (or use `url`), run the client against it, stop the server; the client's
    exit status. The server's prefix cache is kept in `prompt_cache_dir` (None: `default_cache_dir`; "off":
    nowhere) and written there in full before the server stops."""
    executable = client.find()  # before minutes of model loading
    running = app = None
    if url is None:
        from .api import load
        from .server import ServerSettings, create_app, parse_bytes, start_in_thread
        from .server.prefix_store import prepare_folder

        disk_bytes = parse_bytes(prompt_cache_dir_bytes, "--prompt-cache-dir-bytes")
        folder = None if prompt_cache_dir == "off" else \
            str(prepare_folder(prompt_cache_dir or str(default_cache_dir(model, draft))))
        print(f"dflash-mlx: loading {model} for {client.title}...", flush=True)
        settings = ServerSettings(api_key=api_key, max_batch=max_batch, prompt_cache_dir=folder,
                                  prompt_cache_dir_bytes=disk_bytes).name_after(model, draft)
        target, tokenizer, drafter = load(model, draft, quant=quant)
        app = create_app(target, tokenizer, drafter, settings)
        running = start_in_thread(app)
        base = running.base
        print(f"dflash-mlx: serving {settings.model_name} at {base}" +
              (f", prompt cache in {folder}" if folder else ""), flush=True)
    else:
        base = url.rstrip("/").removesuffix("/v1")
    try:
        name, context = served_model(base, api_key)
        if client is CLAUDE:
            return run_client([executable, *args], claude_environment(base, api_key, dict(os.environ), name))
        env = dict(os.environ, DFLASH_MLX_API_KEY=api_key or API_KEY)
        return run_client([executable, *codex_arguments(base, name, context), *args], env)
    finally:
        if running is not None:
            _keep_cache(app)
            running.stop()


def _keep_cache(app) -> None:
    """Write every prefix-cache entry to disk (on the worker thread, between passes) before the server stops:
    unlike a server told to stop by a signal, the launcher has no deadline to meet."""
    server = app.state.server
    if server.generator.store is None:
        return
    try:
        server.worker.call_soon(server.generator.persist).result(timeout=600)
    except Exception as e:  # the session is over anyway; say why the next one may start cold
        print(f"dflash-mlx: the prompt cache could not be written to disk ({e})", file=sys.stderr)
