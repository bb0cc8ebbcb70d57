"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server on the DFlash engine (FastAPI + uvicorn).

    from dflash_mlx import load
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread
    model, tokenizer, drafter = load("qwen2.5-coder-0.5b")
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="coder")))
    print(running.url)        # http://127.0.0.1:PORT/v1 for the openai client
    running.stop()

Modules: app (routes), schemas (request bodies), prompts (chat templates), worker (queue, one generation at a
time), streaming (a job's events for a route), generation (the engine), prefix_cache (snapshots across requests),
text (stop strings, reasoning and tool calls), openai_format / anthropic_format / responses_format (response bodies;
the last also the /v1/responses routes), responses_store (past responses for previous_response_id), memory (gives
freed memory back when idle), metrics (Prometheus text), errors.

Shutdown (Ctrl-C, SIGTERM, `RunningServer.stop`): uvicorn stops accepting, then waits for the responses in flight;
`_Server` first tells the app, whose running generation stops at its next verify pass, so a stream ends with a
final chunk (finish_reason "stop" for OpenAI clients, "cancelled" in its dflash field) and [DONE], within the
5 s uvicorn grants before it cancels what is left. `dflash-mlx serve` checks --host/--port by binding them
(`check_address`) before it spends minutes loading the model.

This package knows nothing of several ranks: `dflash_mlx.distributed.serving` sits above it and serves a target
split over an `mlx.launch` job through `serve_loaded`, wrapping the worker's generator in its `on_app` hook.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

from ..decode.budget import DEFAULT_TREES
from ..errors import DFlashError
from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "check_address", "create_app", "serve", "serve_from_cli", "serve_loaded",
           "settings_from_cli", "start_in_thread", "RunningServer"]

logger = logging.getLogger("dflash_mlx.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class RunningServer:
    """A uvicorn server on a background thread; `url` is the OpenAI base URL (ends in /v1)."""

    host: str
    port: int
    _server: object
    _thread: threading.Thread

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def _uvicorn_server(config):
    """A uvicorn server that tells the app when it starts shutting down: uvicorn waits for the responses in flight
    before the app's lifespan hears of it, and a stream that has thousands of tokens to go would be cancelled mid-way
    (a CancelledError traceback, no finish_reason, no [DONE])."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, *args, **kwargs):
            server = getattr(getattr(self.config.app, "state", None), "server", None)
            if server is not None and hasattr(server, "begin_shutdown"):
                server.begin_shutdown()
            await super().shutdown(*args, **kwargs)

    return _Server(config)


def is_loopback(host: str) -> bool:
    """Whether `host` reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(host: str, port: int) -> None:
    """Bind every address uvicorn will bind for host:port (with SO_REUSEADDR, as it does) and let go at once: a port
    in use or a host this machine cannot listen on is one error now rather than after the model has loaded."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise DFlashError(f"--host {host!r} is not an address of this machine ({getattr(e, 'strerror', None) or e}); "
                          "use e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds "::" beside 0.0.0.0
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DFlashError(f"port {port} on {host} is already in use (another server?): stop it or pick "
                                      "another --port") from None
                raise DFlashError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host (an address of "
                                  "this machine) and --port (below 1024 needs privileges)") from None


def _config(app, host: str, port: int, log_level: str):
    import uvicorn

    # One worker process: the model lives in this process, and generations are queued on one thread anyway.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, workers=1, timeout_graceful_shutdown=5)


def start_in_thread(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> RunningServer:
    """Serve `app` from a background thread (port 0: a free one); returns once it accepts connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = _uvicorn_server(_config(app, host, port, log_level))
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dflash-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # generous: a loaded machine starts slowly, and a failed start ends sooner
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server on {host}:{port} failed to start (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start within 120 s")
        time.sleep(0.02)
    return RunningServer(host, port, server, thread)


def serve_loaded(target, tokenizer, drafter, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8080,
                 log_level: str = "info", on_app: Optional[Callable] = None,
                 prefill_step_size: Optional[int] = None, exit_process: bool = False) -> None:
    """Serve an already loaded pair on host:port until interrupted.

    `on_app(app)` runs once the app exists and before it takes a request: the place a caller adjusts it
    (`dflash_mlx.distributed.serving` wraps the worker's generator so that every rank generates in lockstep).
    With `exit_process` (`dflash-mlx serve`) stopping (Ctrl-C, SIGTERM) takes at most a few seconds
    (`worker.STOP_BY_S`): a prompt chunk still running then is not waited for, and the process ends as the server
    does, without the interpreter's teardown (which could abort beside a worker thread MLX still runs on).
    """
    if not is_loopback(host) and not settings.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    app = create_app(target, tokenizer, drafter, settings)
    if prefill_step_size is not None:
        app.state.server.generator.prefill_step_size = int(prefill_step_size)
    if on_app is not None:
        on_app(app)
    if exit_process:
        from .worker import STOP_BY_S

        app.state.server.worker.stop_by_s = STOP_BY_S
    try:
        _uvicorn_server(_config(app, host, port, log_level)).run()
    except KeyboardInterrupt:
        if exit_process:
            _exit_now(130)
        raise
    if exit_process:
        _exit_now(0)


def _exit_now(code: int) -> None:
    """End the process once the server has stopped, even if the worker thread is still inside a pass MLX cannot
    interrupt (the files it writes are atomic; a temporary one is cleared at the next start)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def serve(model: str, drafter: Optional[str] = None, *, host: str = "127.0.0.1", port: int = 8080,
          quant: Optional[str] = None, settings: Optional[ServerSettings] = None, log_level: str = "info",
          prefill_step_size: Optional[int] = None) -> None:
    """Load a target and drafter with `dflash_mlx.load` and serve them until interrupted (one process; under
    `mlx.launch`, `dflash_mlx.distributed.serving.serve_ranks` splits the target over the ranks)."""
    from ..api import load

    settings = (settings or ServerSettings()).name_after(model, drafter)
    target, tokenizer, draft = load(model, drafter, quant=quant)
    serve_loaded(target, tokenizer, draft, settings, host=host, port=port, log_level=log_level,
                 prefill_step_size=prefill_step_size, exit_process=True)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--prompt-cache-bytes") -> int:
    """'2GiB', '500M', '1e9' or '0' -> bytes (`flag` names the option in the error)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    try:
        if match is None or unit not in _UNITS:
            raise ValueError
        return int(float(match.group(1)) * _UNITS[unit])
    except ValueError:
        raise DFlashError(f"{flag} {text!r} is not a size: give bytes, e.g. 2GiB, 500M or 0") from None


def settings_from_cli(*, model: str, draft: Optional[str], api_key: Optional[str], max_queue: int,
                      prompt_cache_bytes: str, width: Optional[int], max_tokens: Optional[int], temp: float,
                      chat_template_args: Optional[str],
                      served_model_name: Union[None, str, List[str]], max_batch: int = 8,
                      prompt_cache_dir: Optional[str] = None, prompt_cache_dir_bytes: str = "16GiB",
                      strict_model_names: bool = False, tree_budget=DEFAULT_TREES,
                      lookup: Optional[bool] = None) -> ServerSettings:
    """The `dflash-mlx serve` options as settings, every one checked before any model is loaded.
    `served_model_name` may be several names (the flag repeated): the first is the one the server reports."""
    template_args = None
    if chat_template_args:
        try:
            template_args = json.loads(chat_template_args)
        except ValueError as e:
            raise DFlashError(f"--chat-template-args is not JSON: {e}") from None
        if not isinstance(template_args, dict):
            raise DFlashError("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    blank = [n for n in names if not n.strip()]
    if blank:
        raise DFlashError("--served-model-name is empty: give the id clients send as 'model', e.g. "
                          "--served-model-name gpt-4o-mini (repeat the flag for more names)")
    names = names or [model]
    disk_bytes = parse_bytes(prompt_cache_dir_bytes, "--prompt-cache-dir-bytes")
    if prompt_cache_dir:
        from .prefix_store import prepare_folder

        prepare_folder(prompt_cache_dir)
    return ServerSettings(model_name=names[0], served_names=names[1:], drafter_name=draft, api_key=api_key,
                          max_queue=max_queue, prompt_cache_bytes=parse_bytes(prompt_cache_bytes),
                          width=width, default_max_tokens=max_tokens, temperature=temp,
                          chat_template_kwargs=template_args, max_batch=max_batch,
                          prompt_cache_dir=prompt_cache_dir, prompt_cache_dir_bytes=disk_bytes,
                          strict_model_names=strict_model_names, tree_budget=tree_budget, lookup=lookup)


def serve_from_cli(*, model: str, draft: Optional[str], quant: Optional[str], host: str, port: int,
                   settings: ServerSettings, prefill_step_size: Optional[int] = None) -> None:
    """`dflash-mlx serve` in one process, its options checked (`settings_from_cli`): check the address before
    loading the model, then serve."""
    check_address(host, port)
    serve(model, draft, host=host, port=port, quant=quant, settings=settings, prefill_step_size=prefill_step_size)
