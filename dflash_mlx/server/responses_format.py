"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), the one the Agents SDK
and Codex-style clients speak, on the same generation path as chat completions (`Server.submit`).

Requests: `input` (a string, or items: messages with text parts, call items `function_call`, `custom_tool_call`,
`local_shell_call` and their `*_output` items; other items, `reasoning` among them, are skipped), `instructions`
(a leading system message, not carried over to later turns), `tools` (function, namespace and custom tools, see
server/responses_tools.py; others are left out) and `tool_choice`, and `previous_response_id`, which puts the
stored conversation of that response before `input`. System and developer messages after the first turn become
reminders where they stand (`prompts.fold_system_messages`). The prompt is built by `server/prompts.py`, so the
prefix cache serves the shared history and `usage.input_tokens_details.cached_tokens` counts it.

Replies: output items `reasoning`, `message` (one `output_text` part), `function_call` and `custom_tool_call`; streamed as OpenAI's
named SSE events with a `sequence_number`: response.created, response.in_progress, then per item
response.output_item.added, (response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done | response.reasoning_text.delta/done | response.function_call_arguments.delta/done |
response.custom_tool_call_input.delta/done),
response.output_item.done, and last response.completed (response.incomplete when max_output_tokens cut it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict, List, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import prompts
from .errors import APIError, ContextTooLong
from .generation import Delta, Outcome
from .openai_format import dflash_field
from .responses_store import ResponseStore
from .responses_tools import OUTPUT_ITEMS, ToolSet, history_call, new_id
from .schemas import ResponsesRequest
from .streaming import collect, first_event, sse_response
from .text import OutputRouter, Piece, router_for
from .tools import openai_tool_choice

logger = logging.getLogger("dflash_mlx.server")


# -- request -> chat messages ----------------------------------------------------------------------------------
def chat_tool_choice(choice: Any) -> Any:
    """Responses `tool_choice` -> chat-completions form: a named function or custom tool ({"type": "function" |
    "custom", "name": NAME}) -> that function; `allowed_tools` (a subset the model may pick from) -> its mode."""
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    return choice


def _arguments(text: Any) -> Any:
    if isinstance(text, str):
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            return text
    return text


def input_messages(items: Any) -> List[Dict[str, Any]]:
    """`input` -> chat-template messages. Consecutive function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[Dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        call = history_call(item)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got "
                                    f"{role!r}", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": prompts.text_of(item.get("content"), f"{where}.content")})
        elif call is not None:
            call_id, name, arguments = call
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise APIError(400, f"{where}: a {kind} item needs 'call_id' and 'name'", param=where)
            chat_call = {"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": _arguments(arguments)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(chat_call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [chat_call]})
        elif kind in OUTPUT_ITEMS:
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a {kind} item needs the 'call_id' of its call",
                               param=f"{where}.call_id")
            output = item.get("output", "")
            if isinstance(output, dict):  # local_shell_call_output may carry {"output": ..., "metadata": ...}
                output = json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else prompts.text_of(output, f"{where}.output")})
        else:
            # reasoning (chat templates drop earlier turns' reasoning), compaction, web searches, references...:
            # skipped, as OpenAI-compatible servers do with input items they do not know.
            if kind != "reasoning":
                logger.debug("input item of type %r skipped", kind)
            continue
    if not out:
        raise APIError(400, "'input' is empty: send a string or at least one message item", param="input")
    return out


def reply_message(items: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The reply's output items as one assistant chat message (what the next turn's template sees)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}
             for call_id, name, arguments in filter(None, map(history_call, items))]
    if not text and not calls:
        return None
    message: Dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


# -- reply -> output items and events --------------------------------------------------------------------------
class ResponsesFormatter:
    """Fed the generation's events; builds the output items and the SSE events that stream them."""

    def __init__(self, model: str, router: OutputRouter, body: ResponsesRequest, tools: Optional[ToolSet] = None):
        self.id = new_id("resp")
        self.tools = tools or ToolSet()
        self.created = int(time.time())
        self.model = model
        self.router = router
        self.body = body
        self.items: List[Dict[str, Any]] = []
        self.open: Optional[str] = None  # type of the item being streamed ("message" or "reasoning")
        self.sequence = 0
        self.cut = False  # the reply ran into max_output_tokens: its last message is `incomplete`, as OpenAI's

    def _event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, kind: str) -> List[str]:
        events = self._close()
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        self.items.append(item)
        self.open = kind
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=json.loads(json.dumps(item))))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message" \
            else {"type": "reasoning_text", "text": ""}
        item["content"].append(part)
        if kind == "message":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=dict(part)))
        return events

    def _close(self) -> List[str]:
        if self.open is None:
            return []
        item, where = self.items[-1], self._where()
        part = item["content"][0]
        events = []
        if self.open == "message":
            item["status"] = "incomplete" if self.cut else "completed"
            events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.open = None
        return events

    def _call(self, call: Dict[str, Any]) -> List[str]:
        events = self._close()
        item = self.tools.item(call)
        field, stream = ("input", "custom_tool_call_input") if item["type"] == "custom_tool_call" \
            else ("arguments", "function_call_arguments")
        value, item[field] = item[field], ""
        self.items.append(item)
        where = self._where()
        events.append(self._event("response.output_item.added", output_index=where["output_index"], item=dict(item)))
        events.append(self._event(f"response.{stream}.delta", **where, delta=value))
        item.update({field: value, "status": "completed"})
        done = {"name": item["name"], field: value} if field == "arguments" else {field: value}
        events.append(self._event(f"response.{stream}.done", **where, **done))
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _add(self, pieces: List[Piece]) -> List[str]:
        events: List[str] = []
        for p in pieces:
            if p.kind == "tool_call":
                events += self._call(p.call)
                continue
            kind = "message" if p.kind == "content" else "reasoning"
            if not p.text:
                continue
            if self.open != kind:
                events += self._open(kind)
            self.items[-1]["content"][0]["text"] += p.text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(name, **self._where(), content_index=0, delta=p.text, **extra))
        return events

    # -- the response object -----------------------------------------------------------------------------------
    def _status(self, outcome: Optional[Outcome]) -> Dict[str, Any]:
        if outcome is None:
            return {"status": "in_progress", "incomplete_details": None}
        if outcome.finish_reason == "length":
            return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
        if outcome.finish_reason == "cancelled":
            return {"status": "cancelled", "incomplete_details": None}
        return {"status": "completed", "incomplete_details": None}

    def object(self, outcome: Optional[Outcome] = None) -> Dict[str, Any]:
        body = self.body
        obj = {"id": self.id, "object": "response", "created_at": self.created, **self._status(outcome),
               "error": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
               "model": self.model, "output": self.items if outcome is not None else [],
               "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
               "reasoning": body.reasoning or {"effort": None, "summary": None}, "store": body.store,
               "temperature": body.temperature, "top_p": body.top_p,
               "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
               "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
               "truncation": "disabled", "metadata": body.metadata or {}, "usage": None}
        if outcome is not None:
            obj["usage"] = {"input_tokens": outcome.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                            "output_tokens": outcome.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
            obj["dflash"] = dflash_field(outcome)
        return obj

    def failed(self, code: str, message: str) -> List[str]:
        """The whole stream of a response that failed before generating: created, then failed."""
        obj = self.object()
        failed = dict(obj, status="failed", error={"code": code, "message": message})
        return [self._event("response.created", response=obj), self._event("response.failed", response=failed)]

    def start(self) -> List[str]:
        obj = self.object()
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def events(self, delta: Delta) -> List[str]:
        return self._add(self.router.feed(delta.text))

    def finish(self, outcome: Outcome) -> List[str]:
        self.cut = outcome.finish_reason == "length"
        events = self._add(self.router.feed("", final=True)) + self._close()
        obj = self.object(outcome)
        kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=obj)]

    def response(self, outcome: Outcome) -> Dict[str, Any]:
        self.finish(outcome)  # the events are dropped: a whole reply wants only the items
        return self.object(outcome)


# -- routes ----------------------------------------------------------------------------------------------------
def _check_text_format(body: ResponsesRequest) -> None:
    fmt = (body.text or {}).get("format") if isinstance(body.text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise APIError(400, f"text.format {fmt.get('type')!r} is not supported (text only)", param="text.format")


def too_long(fmt: ResponsesFormatter, error: ContextTooLong) -> StreamingResponse:
    """A streamed request over the context learns of it as OpenAI's streams do, in `response.failed`: Codex reads
    the code there and compacts the conversation."""
    return StreamingResponse(iter(fmt.failed(error.code, error.message)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def add_routes(app, server, authorize, store: ResponseStore) -> None:
    def stored(response_id: str, param: Optional[str] = None):
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id '{response_id}' is stored on this server (responses are kept "
                                "in memory, the oldest dropped first, and not with store: false); send the whole "
                                "conversation as input instead", param=param, code="response_not_found")
        return entry

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create(body: ResponsesRequest, request: Request):
        try:
            server.check_body(body)
        except ContextTooLong as e:
            if not body.stream:
                raise
            return too_long(ResponsesFormatter(server.check_model(body.model), None, body), e)
        name = server.check_model(body.model)
        _check_text_format(body)
        if body.max_output_tokens is not None and body.max_output_tokens <= 0:
            raise APIError(400, f"'max_output_tokens' must be at least 1, got {body.max_output_tokens}",
                           param="max_output_tokens")
        history = stored(body.previous_response_id, "previous_response_id").messages \
            if body.previous_response_id else []
        messages = history + input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        toolset = ToolSet.from_request(body.tools)
        tools = toolset.offered
        choice = openai_tool_choice(chat_tool_choice(body.tool_choice), tools)
        if choice.mode == "none":
            tools = None
        template_kwargs = dict(server.settings.chat_template_kwargs or {}, **(body.chat_template_kwargs or {}))
        prompt = await server.chat_prompt(prompts.fold_system_messages(system + messages), tools, template_kwargs,
                                          choice)
        fmt = ResponsesFormatter(name, router_for(server.tokenizer, prompt.text, tools, prompt.forced), body,
                                 toolset)
        try:
            job = server.submit(server.generation_request(prompt, body, body.max_output_tokens, []))
        except ContextTooLong as e:
            if not body.stream:
                raise APIError(400, e.message, param="input", code=e.code) from e
            return too_long(fmt, e)

        def keep(outcome: Outcome) -> None:
            if body.store and outcome.finish_reason != "cancelled":
                reply = reply_message(fmt.items)
                store.put(fmt.id, messages + ([reply] if reply else []), fmt.object(outcome))

        event = await first_event(job, request)
        if event is None:
            return Response(status_code=499)
        if not body.stream:
            outcome = await collect(job, request, event, fmt.events)
            if outcome is None:
                return Response(status_code=499)
            reply = fmt.response(outcome)
            keep(outcome)
            return JSONResponse(reply)

        def error(e: Exception) -> str:  # as OpenAI reports a failure mid-stream
            return fmt._event("error", code="server_error", message=f"{type(e).__name__}: {e}", param=None)

        return sse_response(job, event, start=fmt.start, each=fmt.events, finish=fmt.finish, error=error, done=keep)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def retrieve(response_id: str):
        return stored(response_id).response

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def delete(response_id: str):
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
