"""The server's published schema (`GET /openapi.json`), made to tell the truth: FastAPI's own says every bad body
is a 422 and every reply an empty schema. Here each operation lists the statuses the server really answers
(400 for a bad body, 401 without the key, 404, 413 for a body over the bound, 500 for the unforeseen, 503 when
busy), each error in its route's dialect (OpenAI's or Anthropic's), and the shape of each reply, JSON and, where
the route streams, server-sent events. Fuzzers (tests/test_server_fuzz.py) read it to generate requests."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

from fastapi.openapi.utils import get_openapi

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NULLABLE_STR = {"type": ["string", "null"]}


def _object(required: List[str], **properties) -> Dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


OPENAI_ERROR = _object(["error"], error=_object(["message", "type"], message=_STR, type=_STR,
                                                param=_NULLABLE_STR, code=_NULLABLE_STR))
ANTHROPIC_ERROR = _object(["type", "error"], type={"const": "error"},
                          error=_object(["type", "message"], type=_STR, message=_STR))

_USAGE = _object(["prompt_tokens", "completion_tokens", "total_tokens"], prompt_tokens=_INT,
                 completion_tokens=_INT, total_tokens=_INT)
_MODEL = _object(["id", "object", "created", "owned_by"], id=_STR, object={"const": "model"}, created=_INT,
                 owned_by=_STR)
REPLIES: Dict[str, Dict[str, Any]] = {
    "ChatCompletion": _object(
        ["id", "object", "created", "model", "choices", "usage"], id=_STR, object={"const": "chat.completion"},
        created=_INT, model=_STR, usage=_USAGE,
        choices={"type": "array", "items": _object(
            ["index", "message", "finish_reason"], index=_INT, finish_reason=_STR,
            message=_object(["role"], role={"const": "assistant"}, content=_NULLABLE_STR,
                            reasoning_content=_STR, tool_calls={"type": "array"}))}),
    "TextCompletion": _object(
        ["id", "object", "created", "model", "choices", "usage"], id=_STR, object={"const": "text_completion"},
        created=_INT, model=_STR, usage=_USAGE,
        choices={"type": "array", "items": _object(["index", "text", "finish_reason"], index=_INT, text=_STR,
                                                    finish_reason=_STR)}),
    "Message": _object(
        ["id", "type", "role", "model", "content", "stop_reason", "usage"], id=_STR, type={"const": "message"},
        role={"const": "assistant"}, model=_STR, stop_reason=_STR, stop_sequence=_NULLABLE_STR,
        content={"type": "array", "items": _object(["type"], type=_STR)},
        usage=_object(["input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"],
                      input_tokens=_INT, output_tokens=_INT, cache_read_input_tokens=_INT,
                      cache_creation_input_tokens=_INT)),
    "TokenCount": _object(["input_tokens"], input_tokens=_INT),
    "Response": _object(
        ["id", "object", "created_at", "status", "model", "output"], id=_STR, object={"const": "response"},
        created_at=_INT, model=_STR, status={"enum": ["completed", "incomplete", "cancelled", "in_progress"]},
        output={"type": "array", "items": _object(["type"], type=_STR)}),
    "ResponseDeleted": _object(["id", "object", "deleted"], id=_STR, object={"const": "response.deleted"},
                               deleted={"type": "boolean"}),
    "Model": _MODEL,
    "ModelList": _object(["object", "data"], object={"const": "list"}, data={"type": "array", "items": _MODEL}),
    "Health": _object(["status", "model", "waiting", "running"], status=_STR, model=_STR, waiting=_INT,
                      running=_INT),
    "ServerInfo": _object(["name", "version", "endpoints"], name=_STR, version=_STR,
                          endpoints={"type": "array", "items": _STR}),
    "ServerSentEvent": _object(["data"], event=_STR, data=_STR),
    "OpenAIError": OPENAI_ERROR,
    "AnthropicError": ANTHROPIC_ERROR,
}

_WHY = {400: "the request is malformed: the message names the field and what to send",
        401: "the server has an API key and the request did not send it",
        404: "no such model (with --strict-model-names) or stored response",
        413: "the body, or the text in one field, is over the server's bound; the message names both sizes",
        500: "an unforeseen failure, logged by the server (the connection stays usable)",
        503: "the queue is full or the server is going down: retry later"}
_GENERATES = [200, 400, 401, 404, 413, 500, 503]
# path -> method -> (reply schema, statuses, streams)
ROUTES: Dict[str, Dict[str, tuple]] = {
    "/v1/chat/completions": {"post": ("ChatCompletion", _GENERATES, True)},
    "/v1/completions": {"post": ("TextCompletion", _GENERATES, True)},
    "/v1/messages": {"post": ("Message", _GENERATES, True)},
    "/v1/messages/count_tokens": {"post": ("TokenCount", [200, 400, 401, 404, 413, 500], False)},
    "/v1/responses": {"post": ("Response", _GENERATES, True)},
    "/v1/responses/{response_id}": {"get": ("Response", [200, 401, 404, 500], False),
                                    "delete": ("ResponseDeleted", [200, 401, 404, 500], False)},
    "/v1/models": {"get": ("ModelList", [200, 401, 500], False)},
    "/v1/models/{name}": {"get": ("Model", [200, 401, 404, 500], False)},
    "/health": {"get": ("Health", [200, 503], False), "head": (None, [200, 503], False)},
    "/": {"get": ("ServerInfo", [200], False), "head": (None, [200], False)},
    "/metrics": {"get": (None, [200, 401, 500], False)},
}


def _ref(name: str) -> Dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(path: str, method: str, reply, statuses, streams: bool) -> Dict[str, Any]:
    error = _ref("AnthropicError" if path.startswith("/v1/messages") else "OpenAIError")
    out: Dict[str, Any] = {}
    for status in statuses:
        if status == 503 and path == "/health":
            out["503"] = {"description": "the worker has stopped", "content": {"application/json": {
                "schema": _ref("Health")}}}
        elif status != 200:
            out[str(status)] = {"description": _WHY[status], "content": {"application/json": {"schema": error}}}
            continue
        content: Dict[str, Any] = {}
        if path == "/metrics":
            content["text/plain"] = {"schema": _STR}
        elif reply is not None:
            content["application/json"] = {"schema": _ref(reply)}
        if streams:  # each event: `event:` (named events; Anthropic's, Responses') and `data:` (JSON, or [DONE])
            content["text/event-stream"] = {"schema": _ref("ServerSentEvent")}
        out["200"] = {"description": "the reply" + (" (server-sent events with stream: true)" if streams else ""),
                      **({"content": content} if content else {})}
    return out


def schema(app) -> Dict[str, Any]:
    """FastAPI's schema with the statuses, errors and replies the server really has (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    with warnings.catch_warnings():  # FastAPI's operation ids repeat for GET+HEAD routes; they are rewritten below
        warnings.simplefilter("ignore")
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="DFlash speculative decoding behind OpenAI's and Anthropic's HTTP APIs")
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(REPLIES)
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            operation["operationId"] = f"{method}_{path.strip('/').replace('/', '_').strip('{}') or 'root'}" \
                .replace("{", "").replace("}", "")
            known = ROUTES.get(path, {}).get(method)
            if known is not None:
                operation["responses"] = _responses(path, method, *known)
            else:  # a route added later: at least no 422 that never comes
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses.setdefault("400", {"description": _WHY[400],
                                             "content": {"application/json": {"schema": _ref("OpenAIError")}}})
    spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                             "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    app.openapi_schema = spec
    return spec


def install(app) -> None:
    app.openapi = lambda: schema(app)
