"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server on the DFlash engine (FastAPI + uvicorn).

    from dflash_mlx import load
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread
    model, tokenizer, drafter = load("qwen2.5-coder-0.5b")
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="coder")))
    print(running.url)        # http://127.0.0.1:PORT/v1 for the openai client
    running.stop()

Modules: app (routes), schemas (request bodies), prompts (chat templates), worker (queue, one generation at a
time), generation (the engine), prefix_cache (snapshots across requests), text (stop strings, reasoning and tool
calls), openai_format / anthropic_format (response bodies), metrics (Prometheus text), errors.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app", "serve", "start_in_thread", "RunningServer"]

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


def _config(app, host: str, port: int, log_level: str):
    import uvicorn

    # One worker process: the model lives in this process, and generations are queued on one thread anyway.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, workers=1, timeout_graceful_shutdown=5)


def start_in_thread(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> RunningServer:
    """Serve `app` from a background thread (port 0: a free one); returns once it accepts connections."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(_config(app, host, port, log_level))
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dflash-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.02)
    return RunningServer(host, port, server, thread)


def serve(model: str, drafter: Optional[str] = None, *, host: str = "127.0.0.1", port: int = 8080,
          quant: Optional[str] = None, settings: Optional[ServerSettings] = None, log_level: str = "info") -> None:
    """Load a target and drafter with `dflash_mlx.load` and serve them until interrupted."""
    import uvicorn

    from ..api import load

    settings = settings or ServerSettings()
    if host not in LOOPBACK and not settings.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    target, tokenizer, draft = load(model, drafter, quant=quant)
    if settings.model_name == "default":
        settings.model_name = model
    if settings.drafter_name is None:
        settings.drafter_name = drafter or "shipped"
    app = create_app(target, tokenizer, draft, settings)
    uvicorn.Server(_config(app, host, port, log_level)).run()
