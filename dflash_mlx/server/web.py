"""`dflash-mlx chat --web`: serve the pair on a loopback port and open the chat page in the default browser."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
import webbrowser
from typing import Optional

from . import ServerSettings, serve_loaded
from ..decode.budget import DEFAULT_TREES


def open_when_ready(url: str, open_browser: bool, timeout: float = 600.0) -> threading.Thread:
    """Once `url` answers /health, print it and (unless told not to) open it in the browser. A daemon thread:
    the server runs in the main thread, where Ctrl-C stops it."""

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            return
        print(f"chat page: {url}  (Ctrl-C stops the server)", file=sys.stderr, flush=True)
        if open_browser and not webbrowser.open(url):
            print("no browser could be opened here: open the address above in one", file=sys.stderr, flush=True)

    thread = threading.Thread(target=wait, name="dflash-open-page", daemon=True)
    thread.start()
    return thread


def chat_in_browser(loaded, *, model: str, draft: Optional[str], port: int, open_browser: bool,
                    max_tokens: Optional[int], width: Optional[int], temp: float,
                    tree_budget=DEFAULT_TREES, lookup: Optional[bool] = None) -> None:
    """Serve `loaded` (target, tokenizer, drafter) on 127.0.0.1:`port` with its chat page until interrupted."""
    target, tokenizer, drafter = loaded
    settings = ServerSettings(default_max_tokens=max_tokens if max_tokens and max_tokens > 0 else None,
                              width=width, temperature=temp, tree_budget=tree_budget,
                              lookup=lookup).name_after(model, draft)
    host = "127.0.0.1"
    open_when_ready(f"http://{host}:{port}/", open_browser)
    serve_loaded(target, tokenizer, drafter, settings, host=host, port=port, log_level="warning")
