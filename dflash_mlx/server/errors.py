"""Errors the server answers with: OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) on /v1
routes, Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on /v1/messages."""

from __future__ import annotations

from typing import Optional

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


def _describe(errors) -> tuple:
    """One line from pydantic's error list, and the offending parameter."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")), None
    message = first.get("msg", "invalid request")
    return (f"invalid '{param}': {message}" if param else message), param


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _describe(exc.errors())
        return error_response(request, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail),
                              type="not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
