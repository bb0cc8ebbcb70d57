"""Errors the server answers with: OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) on /v1
routes, Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on /v1/messages."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class ContextTooLong(APIError):
    """A prompt of `tokens` tokens (None: not counted, its text alone is too big) for a context of `limit`."""

    def __init__(self, message: str, tokens: Optional[int], limit: int, param: Optional[str] = "messages"):
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.tokens, self.limit = tokens, limit


def error_response(request: Request, status: int, message: str, type: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    # A message that quotes the client's text may hold a lone surrogate, which UTF-8 cannot carry: escape it.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if request.url.path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


# pydantic's error types -> what the field should have been, as JSON says it
_EXPECTED = {"string_type": "a string", "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object", "int_type": "an integer", "int_parsing": "an integer",
             "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number",
             "bool_type": "true or false", "bool_parsing": "true or false"}


def json_kind(value: Any) -> str:
    """How JSON names a value's type, for error messages: 'a number', 'an array'..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def field_path(error: Dict[str, Any], body: Any) -> Tuple[str, Any]:
    """pydantic's location of an error -> the field's path in the body ('messages.0.content') and its value. The
    tags pydantic puts in for the members of a union ('str', 'list[int]') are no fields: they are left out (a
    tag that is also a key of the body's object is told apart by the value the error was about)."""
    loc = list(error.get("loc", ()))
    loc = loc[1:] if loc and loc[0] == "body" else loc
    missing = error.get("type") == "missing"
    walks = [_walk(loc, body, missing, keys_first=True), _walk(loc, body, missing, keys_first=False)]
    for parts, value in walks:
        if "input" not in error or value is error["input"] or (missing and value is None):
            return ".".join(parts), value
    return ".".join(walks[0][0]), walks[0][1]


def _walk(loc, body: Any, missing: bool, keys_first: bool) -> Tuple[List[str], Any]:
    parts: List[str] = []
    value = body
    for i, p in enumerate(loc):
        if isinstance(value, dict) and isinstance(p, str) and p in value and (keys_first or not _TAG.match(p)):
            value = value[p]
        elif isinstance(value, list) and isinstance(p, int) and 0 <= p < len(value):
            value = value[p]
        elif missing and i == len(loc) - 1:
            value = None
        else:
            continue
        parts.append(str(p))
    return parts, value


_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|function-.*|constrained-.*)$")


def _describe(errors, body: Any) -> Tuple[str, Optional[str]]:
    """One line from pydantic's error list, and the offending field's path. Of a union's errors, those on the
    deepest field are the ones the client most likely meant; their expected types are joined."""
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(errors[0].get("ctx", {}).get("error", "")), None
    found = [(field_path(e, body), e) for e in errors]
    deepest = max(len(path.split(".")) if path else 0 for (path, _), _ in found)
    chosen = [(path, value, e) for (path, value), e in found if (len(path.split(".")) if path else 0) == deepest]
    path, value, first = chosen[0]
    chosen = [c for c in chosen if c[0] == path]
    if first.get("type") == "missing":
        return (f"'{path}' is required: add it to the request body" if path else "the request body is empty"), \
            path or None
    expected = list(dict.fromkeys(_EXPECTED.get(e.get("type"), "") for _, _, e in chosen))
    where = f"'{path}'" if path else "the request body"
    if all(expected):
        return f"invalid {where}: expected {' or '.join(expected)}, got {json_kind(value)}", path or None
    return f"invalid {where}: {first.get('msg', 'invalid value')}", path or None


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _describe(exc.errors(), getattr(exc, "body", None))
        return error_response(request, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail),
                              type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
