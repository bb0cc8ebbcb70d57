"""What every request passes before a route sees it, as plain ASGI middleware: the API key, the body's size,
type and shape, and a last-resort answer for a failure no route foresaw.

- `KeyCheck`: with an API key set, every route but /health (and the chat page at / and its files under
  /static/, which a browser loads before the page can ask for the key) wants `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time.
- `BodyCheck`: a POST body must be JSON (`Content-Type: application/json`, or none), at most `max_bytes` long
  (413, naming both sizes), not empty (400, naming the fields the route needs), an object, and nested at most
  `MAX_DEPTH` deep. The body read here is handed on unchanged.
- `LastResort`: an exception that reaches it is answered with one error in the route's dialect and logged in
  one line (the traceback goes to the debug log only), so the client's keep-alive connection stays usable.

Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which would hide a client's disconnect from handlers.
"""

from __future__ import annotations

import hmac
import json
import logging
import traceback
from typing import Dict, Optional, Tuple

from starlette.requests import Request

from .errors import error_response, json_kind

logger = logging.getLogger("dflash_mlx.server")

MAX_DEPTH = 64  # JSON nesting: chat requests need about 10 (tool schemas nest deepest)
PUBLIC_PATHS = ("/health", "/")  # load balancers, uptime probes and the browser's first page load
# The chat page's own files (the package's static files, no data of anyone's): a browser loads them before the
# page can ask for the key.
PUBLIC_PREFIX = "/static/"
# The fields each route needs, for the message that answers an empty body.
REQUIRED = {"/v1/chat/completions": "'messages'", "/v1/completions": "'prompt'", "/v1/responses": "'input'",
            "/v1/messages": "'messages' and 'max_tokens'", "/v1/messages/count_tokens": "'messages'"}


async def _answer(scope, receive, send, status: int, message: str, *, type: str = "invalid_request_error",
                  param: Optional[str] = None, code: Optional[str] = None) -> None:
    response = error_response(Request(scope), status, message, type, param, code)
    await response(scope, receive, send)


class KeyCheck:
    """Refuse, with a 401, a request without the server's API key (all routes but `PUBLIC_PATHS`)."""

    def __init__(self, app, key: Optional[str]):
        self.app, self.key = app, (key or "").encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path") or ""
        public = path in PUBLIC_PATHS or (path.startswith(PUBLIC_PREFIX) and scope.get("method") in ("GET", "HEAD"))
        if scope["type"] != "http" or not self.key or public:
            return await self.app(scope, receive, send)
        if not hmac.compare_digest(given_key(Request(scope).headers).encode(), self.key):
            return await _answer(scope, receive, send, 401,
                                 "invalid API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY') with the "
                                 "server's --api-key", type="authentication_error", code="invalid_api_key")
        await self.app(scope, receive, send)


def given_key(headers) -> str:
    """The key a client sent: `Authorization: Bearer KEY`, else `x-api-key` (Anthropic's clients)."""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key") or ""


class BodyCheck:
    """Read a POST body once, check it (size, type, emptiness, shape, depth), and pass it on as it came."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        headers = Request(scope).headers
        problem = self._header_problem(headers)
        if problem is None:
            body, problem = await self._read(receive, headers)
        if problem is None:
            problem = self._body_problem(body, scope.get("path", ""))
        if problem is not None:
            status, message, param = problem
            return await _answer(scope, receive, send, status, message, param=param,
                                 code="request_too_large" if status == 413 else None)
        sent = False

        async def replay():  # the body once, then the client's own messages (a disconnect, say)
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_big(self, size: str) -> Tuple[int, str, None]:
        return 413, (f"the request body is {size} bytes, over this server's limit of {self.max_bytes} bytes; "
                     "send less (long documents belong in fewer, shorter requests)"), None

    def _header_problem(self, headers) -> Optional[Tuple[int, str, None]]:
        kind = (headers.get("content-type") or "").split(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            return 400, (f"the request body must be JSON, sent with 'Content-Type: application/json' (this one "
                         f"came as '{kind}')"), None
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return self._too_big(length)
        return None

    async def _read(self, receive, headers) -> Tuple[bytes, Optional[tuple]]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (400, "the client went away before sending its whole body", None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return b"", self._too_big(f"over {self.max_bytes}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _body_problem(self, body: bytes, path: str) -> Optional[Tuple[int, str, Optional[str]]]:
        if not body.strip():
            needs = REQUIRED.get(path)
            return 400, ("the request body is empty: send a JSON object" +
                         (f" with {needs}" if needs else "")), None
        try:
            value = json.loads(body)
        except RecursionError:
            return 400, f"the request body nests deeper than {MAX_DEPTH} levels of JSON", None
        except ValueError as e:  # UnicodeDecodeError included
            return 400, f"the request body is not valid JSON: {e}", None
        if not isinstance(value, dict):
            return 400, f"the request body must be a JSON object ({{...}}), got {json_kind(value)}", None
        where = too_deep(value)
        if where is not None:
            return 400, f"the request body nests deeper than {MAX_DEPTH} levels of JSON (at '{where}')", where
        return None


def too_deep(value, limit: int = MAX_DEPTH) -> Optional[str]:
    """The path of a value nested deeper than `limit`, or None; walked without recursion."""
    stack = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return path
                stack.append((child, depth + 1, path))
    return None


class LastResort:
    """Answer an exception no handler took with one error in the route's dialect (500), log one line. Starlette's
    own fallback re-raises after answering, which closes the client's keep-alive connection and logs a
    traceback; here the connection stays usable."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Dict):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
            logger.error("%s %s failed: %s: %s%s", scope.get("method"), scope.get("path"), type(e).__name__, e, at)
            logger.debug("the failure's traceback", exc_info=e)
            if started:  # the status line has gone out: nothing more can be said on this response
                return
            await _answer(scope, receive, send, 500, f"internal error: {type(e).__name__}; the server's log has "
                                                     "the details", type="server_error")
