"""The chat page: `GET /` for a browser (its Accept header asks for HTML) and its files under `/static/`.

The page (server/static/: index.html, app.js, style.css, and pinned copies of marked and highlight.js with their
licenses in static/vendor/) has no build step and loads nothing from any other host, so it works offline. It talks
to the server's own `/v1/chat/completions`, asking for per-token origins (`"dflash": {"origins": true}`).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# The page may load only what this server serves (and inline data: images); nothing from another host.
POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
          "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def wanted(accept: str) -> bool:
    """Browsers ask for text/html first; API clients and probes (JSON, */*, nothing) keep the JSON answer."""
    return "text/html" in accept.lower()


def index() -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-cache"})


def add_routes(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
