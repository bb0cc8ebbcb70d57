"""OpenAI response bodies: chat completions and text completions, whole or as stream chunks.

A formatter is fed the generation's events (`Delta`s, then the `Outcome`) and returns the JSON objects to send.
Chat replies go through an `OutputRouter`, so reasoning lands in `reasoning_content` and tool calls in
`tool_calls` (never as markup in `content`). Every final object carries the DFlash statistics under `"dflash"`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional

from .generation import Delta, Outcome, TokenLogprob
from .text import OutputRouter, Piece
from .tokenizer_lock import tokenizer_lock

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def usage(outcome: Outcome) -> Dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def dflash_field(outcome: Outcome) -> Dict[str, Any]:
    return dict(outcome.stats, prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                cached_tokens=outcome.cached_tokens, finish_reason=outcome.finish_reason)


class _TokenText:
    """Token ids -> text and bytes for log-probabilities (cached: the same ids come back often)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: Dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            with tokenizer_lock(self.tokenizer):  # shared with the worker thread
                text = self.cache[token] = self.tokenizer.decode([token])
        return text


class ChatFormatter:
    """`origins` (the request's `"dflash": {"origins": true}`): each chunk carries where its tokens came from, and
    the final object counts them (the chat page marks every token with it)."""

    def __init__(self, model: str, tokenizer, router: OutputRouter, *, logprobs: bool = False,
                 include_usage: bool = False, origins: bool = False):
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.router = router
        self.token_text = _TokenText(tokenizer)
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.content, self.reasoning = "", ""
        self.tool_calls: List[Dict[str, Any]] = []
        self.logprob_items: List[Dict[str, Any]] = []
        self.origins = origins
        self.origin_tokens: List[Dict[str, str]] = []

    # -- shared ---------------------------------------------------------------------------------------------
    def _logprob_items(self, items: Optional[List[TokenLogprob]]) -> List[Dict[str, Any]]:
        out = []
        for lp in items or []:
            text = self.token_text(lp.token)
            out.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                          "bytes": list(self.token_text(t).encode())} for t, v in lp.top]})
        return out

    def _tool_call(self, call: Dict[str, Any]) -> Dict[str, Any]:
        arguments = call.get("arguments", {})
        return {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.get("name", ""),
                             "arguments": arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False)}}

    def _route(self, text: str, final: bool) -> List[Piece]:
        pieces = self.router.feed(text, final=final)
        for p in pieces:
            if p.kind == "content":
                self.content += p.text
            elif p.kind == "reasoning":
                self.reasoning += p.text
        return pieces

    def _origin_tokens(self, event: Delta) -> List[Dict[str, str]]:
        if not self.origins:
            return []
        tokens = [{"text": text, "origin": origin} for text, origin in zip(event.segments, event.origins)]
        self.origin_tokens.extend(tokens)
        return tokens

    def _dflash(self, outcome: Outcome, tokens: bool = False) -> Dict[str, Any]:
        out = dflash_field(outcome)
        if self.origins:
            counts = {"drafter": 0, "lookup": 0, "target": 0}
            for t in self.origin_tokens:
                counts[t["origin"]] += 1
            out["origin_counts"] = counts
            if tokens:
                out["tokens"] = self.origin_tokens
        return out

    def _finish_reason(self, outcome: Outcome) -> str:
        if self.tool_calls and outcome.finish_reason == "stop":
            return "tool_calls"
        return FINISH[outcome.finish_reason]

    # -- streaming -------------------------------------------------------------------------------------------
    def _chunk(self, delta: Dict[str, Any], finish: Optional[str] = None, logprobs=None) -> Dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self) -> Dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def chunks(self, event: Delta, final: bool = False) -> List[Dict[str, Any]]:
        out = []
        logprobs = self._logprob_items(event.logprobs) if self.logprobs else None
        for p in self._route(event.text, final):
            if p.kind == "content":
                out.append(self._chunk({"content": p.text}))
            elif p.kind == "reasoning":
                out.append(self._chunk({"reasoning_content": p.text}))
            else:
                call = dict(self._tool_call(p.call), index=len(self.tool_calls))
                self.tool_calls.append(call)
                out.append(self._chunk({"tool_calls": [call]}))
        if logprobs:
            if out:
                out[0]["choices"][0]["logprobs"] = {"content": logprobs}
            else:
                out.append(self._chunk({"content": ""}, logprobs={"content": logprobs}))
        tokens = self._origin_tokens(event)
        if tokens:
            if not out:
                out.append(self._chunk({"content": ""}))
            out[0]["dflash"] = {"tokens": tokens}
        return out

    def final_chunks(self, outcome: Outcome) -> List[Dict[str, Any]]:
        out = self.chunks(Delta("", []), final=True)
        last = self._chunk({}, finish=self._finish_reason(outcome))
        last["dflash"] = self._dflash(outcome)
        out.append(last)
        if self.include_usage:
            out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "choices": [], "usage": usage(outcome), "dflash": self._dflash(outcome)})
        return out

    # -- whole response --------------------------------------------------------------------------------------
    def add(self, event: Delta) -> None:
        for p in self._route(event.text, final=False):
            if p.kind == "tool_call":
                self.tool_calls.append(self._tool_call(p.call))
        if self.logprobs:
            self.logprob_items.extend(self._logprob_items(event.logprobs))
        self._origin_tokens(event)

    def response(self, outcome: Outcome) -> Dict[str, Any]:
        for p in self._route("", final=True):
            if p.kind == "tool_call":
                self.tool_calls.append(self._tool_call(p.call))
        message: Dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": self.logprob_items} if self.logprobs else None,
                         "finish_reason": self._finish_reason(outcome)}],
            "usage": usage(outcome),
            "dflash": self._dflash(outcome, tokens=True),
        }


class CompletionFormatter:
    """/v1/completions: raw text, legacy log-probabilities (`tokens`, `token_logprobs`, `top_logprobs`)."""

    def __init__(self, model: str, tokenizer, *, logprobs: Optional[int] = None, include_usage: bool = False):
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.token_text = _TokenText(tokenizer)
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.text = ""
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _logprobs(self, items: Optional[List[TokenLogprob]], offset: int) -> Optional[Dict[str, Any]]:
        if self.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items or []:
            text = self.token_text(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.token_text(t): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _chunk(self, text: str, finish: Optional[str], logprobs) -> Dict[str, Any]:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, event: Delta) -> List[Dict[str, Any]]:
        logprobs = self._logprobs(event.logprobs, len(self.text))
        self.text += event.text
        if not event.text and not (logprobs and logprobs["tokens"]):
            return []
        return [self._chunk(event.text, None, logprobs)]

    def final_chunks(self, outcome: Outcome) -> List[Dict[str, Any]]:
        last = self._chunk("", FINISH[outcome.finish_reason], None)
        last["dflash"] = dflash_field(outcome)
        out = [last]
        if self.include_usage:
            out.append({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                        "choices": [], "usage": usage(outcome), "dflash": dflash_field(outcome)})
        return out

    def add(self, event: Delta) -> None:
        logprobs = self._logprobs(event.logprobs, len(self.text))
        if logprobs:
            for key in self.lp:
                self.lp[key].extend(logprobs[key])
        self.text += event.text

    def response(self, outcome: Outcome) -> Dict[str, Any]:
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": self.text, "logprobs": self.lp if self.logprobs is not None else None,
                         "finish_reason": FINISH[outcome.finish_reason]}],
            "usage": usage(outcome),
            "dflash": dflash_field(outcome),
        }
