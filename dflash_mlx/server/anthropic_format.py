"""Anthropic's Messages API (`POST /v1/messages`, streaming or not, and `/v1/messages/count_tokens`), so
Claude-Code-style clients can use the server: content blocks (text, thinking, tool_use), `stop_reason`, and the
named SSE events (message_start, content_block_*, message_delta, message_stop)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from typing import Any, Dict, List, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from . import prompts
from .errors import APIError, ContextTooLong, json_kind
from .generation import Delta, Outcome
from .openai_format import dflash_field
from .schemas import AnthropicCountRequest, AnthropicRequest
from .streaming import collect, first_event, sse_response
from .text import OutputRouter, router_for
from .tools import anthropic_tool_choice
from .worker import Job

STOP_REASONS = {"length": "max_tokens", "cancelled": "end_turn"}


def _text(content: Any, where: str) -> str:
    """A system prompt's or a tool result's content as text: a string, or its text blocks (images and other
    blocks are left out); null is empty. Anything else is a 400 naming the field."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"'{where}' must be a string or an array of content blocks, got {json_kind(content)}",
                       param=where)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise APIError(400, f"'{where}.{i}' must be a content block, {{\"type\": \"text\", \"text\": \"...\"}}, "
                                f"got {json_kind(block)}", param=f"{where}.{i}")
    return prompts.text_of([b for b in content if b.get("type") == "text"], where)


def chat_messages(body) -> List[Dict[str, Any]]:
    """Anthropic system + messages -> chat-template messages (tool_use -> tool_calls, tool_result -> tool).
    System messages inside `messages` become reminders in place (`prompts.fold_system_messages`)."""
    out: List[Dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    if not body.messages:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages")
    for i, m in enumerate(body.messages):
        if m.role == "system":
            out.append({"role": "system", "content": _text(m.content, f"messages.{i}.content")})
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content"), f"messages.{i}.content.{j}.content")})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # templates drop earlier reasoning
            else:
                raise APIError(400, f"'messages.{i}.content.{j}': content blocks of type {kind!r} are not supported "
                                    f"in a{'n' if m.role == 'assistant' else ''} {m.role} message",
                               param=f"messages.{i}.content.{j}")
        if texts or calls:
            message: Dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return prompts.fold_system_messages(out)


def openai_tools(tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def thinking_signature(text: str) -> str:
    """An opaque signature for a thinking block (this server's, checked by nobody; clients want one present)."""
    return "dflash-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _event(name: str, data: Dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessagesFormatter:
    def __init__(self, model: str, router: OutputRouter, prompt_tokens: int):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.router = router
        self.prompt_tokens = prompt_tokens
        self.blocks: List[Dict[str, Any]] = []
        self.open: Optional[str] = None  # kind of the streaming block now open

    def _stop_reason(self, outcome: Outcome) -> str:
        if outcome.stop_string is not None:
            return "stop_sequence"
        if any(b["type"] == "tool_use" for b in self.blocks) and outcome.finish_reason == "stop":
            return "tool_use"
        return STOP_REASONS.get(outcome.finish_reason, "end_turn")

    def _usage(self, outcome: Outcome) -> Dict[str, Any]:
        return {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
                "cache_read_input_tokens": outcome.cached_tokens, "cache_creation_input_tokens": 0,
                "output_tokens": outcome.completion_tokens}

    def _add(self, pieces) -> List[str]:
        """Append pieces to the content blocks; returns the SSE events that stream them."""
        events = []
        for p in pieces:
            kind = {"content": "text", "reasoning": "thinking", "tool_call": "tool_use"}[p.kind]
            if kind == "tool_use":
                block = {"type": "tool_use", "id": p.call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                         "name": p.call.get("name", ""), "input": p.call.get("arguments", {})}
                if isinstance(block["input"], str):
                    try:
                        block["input"] = json.loads(block["input"])
                    except ValueError:
                        block["input"] = {"raw": block["input"]}
                events += self._close()
                self.blocks.append(block)
                index = len(self.blocks) - 1
                events.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": dict(block, input={})}))
                events.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
                events += self._close(force=True)
                continue
            if self.open != kind:
                events += self._close()
                self.blocks.append({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""})
                self.open = kind
                events.append(_event("content_block_start", {"type": "content_block_start",
                                                             "index": len(self.blocks) - 1,
                                                             "content_block": dict(self.blocks[-1])}))
            field = "thinking" if kind == "thinking" else "text"
            self.blocks[-1][field] += p.text
            events.append(_event("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": f"{field}_delta", field: p.text}}))
        return events

    def _close(self, force: bool = False) -> List[str]:
        if self.open is None and not force:
            return []
        events = []
        if self.open == "thinking":
            # Clients drop unsigned thinking blocks (Claude Code does): sign it, as Anthropic does, last.
            block = self.blocks[-1]
            block["signature"] = thinking_signature(block["thinking"])
            events.append(_event("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "signature_delta", "signature": block["signature"]}}))
        self.open = None
        return events + [_event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def start(self, first=None) -> List[str]:
        """The opening event; `first` (the generation's first event) tells how much of the prompt was cached."""
        cached = getattr(first, "cached_tokens", 0) or 0
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens - cached, "cache_read_input_tokens": cached,
                             "cache_creation_input_tokens": 0, "output_tokens": 0}}
        return [_event("message_start", {"type": "message_start", "message": message})]

    def events(self, delta: Delta) -> List[str]:
        return self._add(self.router.feed(delta.text))

    def finish(self, outcome: Outcome) -> List[str]:
        events = self._add(self.router.feed("", final=True)) + self._close()
        events.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": self._stop_reason(outcome),
                                               "stop_sequence": outcome.stop_string},
            "usage": self._usage(outcome), "dflash": dflash_field(outcome)}))
        events.append(_event("message_stop", {"type": "message_stop"}))
        return events

    def response(self, outcome: Outcome) -> Dict[str, Any]:
        self._add(self.router.feed("", final=True))
        self._close()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self._stop_reason(outcome),
                "stop_sequence": outcome.stop_string, "usage": self._usage(outcome),
                "dflash": dflash_field(outcome)}


def _stream_error(e: Exception) -> str:
    return _event("error", {"type": "error", "error": {"type": "api_error", "message": str(e)}})


def _template_kwargs(server, body) -> Dict[str, Any]:
    kwargs = dict(server.settings.chat_template_kwargs or {})
    thinking = getattr(body, "thinking", None)
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        kwargs["enable_thinking"] = thinking["type"] == "enabled"
    return kwargs


@contextlib.contextmanager
def anthropic_wording():
    """A prompt over the context is refused in Anthropic's words, `prompt is too long: …`: Claude Code compacts
    the conversation on that message, and gives up on any other."""
    try:
        yield
    except ContextTooLong as e:
        counted = f"{e.tokens} tokens > {e.limit} maximum" if e.tokens is not None else e.message
        raise APIError(400, f"prompt is too long: {counted}", param=e.param, code=e.code) from e


def add_routes(app, server, authorize) -> None:
    @app.post("/v1/messages", dependencies=[Depends(authorize)])
    async def messages(body: AnthropicRequest, request: Request):
        with anthropic_wording():
            server.check_body(body)
        name = server.check_model(body.model)
        tools = openai_tools(body.tools)
        choice = anthropic_tool_choice(body.tool_choice, tools)
        if choice.mode == "none":
            tools = None
        prompt = await server.chat_prompt(chat_messages(body), tools, _template_kwargs(server, body), choice)
        with anthropic_wording():
            request_ = server.generation_request(prompt, body, body.max_tokens, list(body.stop_sequences or []))
        job: Job = server.submit(request_)
        router = router_for(server.tokenizer, prompt.text, tools, prompt.forced)
        fmt = MessagesFormatter(name, router, len(prompt.tokens))
        event = await first_event(job, request)
        if event is None:
            return Response(status_code=499)
        if not body.stream:
            outcome = await collect(job, request, event, fmt.events)
            return Response(status_code=499) if outcome is None else JSONResponse(fmt.response(outcome))

        return sse_response(job, event, start=lambda: fmt.start(event), each=fmt.events, finish=fmt.finish, error=_stream_error)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorize)])
    async def count_tokens(body: AnthropicCountRequest):
        with anthropic_wording():
            server.check_body(body)
        server.check_model(body.model)
        prompt = await server.chat_prompt(chat_messages(body), openai_tools(body.tools),
                                          _template_kwargs(server, body))
        return {"input_tokens": len(prompt.tokens)}
