"""From request messages to prompt tokens: chat template (with tools and template switches), message boundaries
for the prefix cache, and the one-line errors for messages the template cannot take."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import APIError, json_kind
from .tokenizer_lock import tokenizer_lock
from .tools import ForcedStart, ToolChoice, forced_start


@dataclass
class Prompt:
    tokens: List[int]
    text: str
    boundaries: List[int] = field(default_factory=list)  # token positions where a message ends
    forced: Optional[ForcedStart] = None  # the start of a forced tool call, at the end of `text`


def text_of(content: Any, where: str) -> str:
    """Message content as text: null, a string, or a list of text parts ({"type": "text", "text": ...}); anything
    else is a 400 naming the field."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{where}' must be a string or an array of text parts, got {json_kind(content)}",
                       param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif not isinstance(part, dict):
            raise APIError(400, f"'{where}.{i}' must be a text part, {{\"type\": \"text\", \"text\": \"...\"}}, got "
                                f"{json_kind(part)}", param=f"{where}.{i}")
        else:
            raise APIError(400, f"'{where}.{i}': content parts of type {kind!r} are not supported (text only, "
                                "with its 'text' a string)", param=where)
    return "".join(parts)


def _arguments(args: Any) -> Any:
    # Templates iterate over arguments as a mapping; clients send them as a JSON string.
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


ROLES = {"developer": "system", "function": "tool"}  # the chat templates' names for the roles OpenAI added


def openai_messages(messages) -> List[Dict[str, Any]]:
    """Pydantic chat messages -> the dicts chat templates expect."""
    if not messages:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        d: Dict[str, Any] = {"role": ROLES.get(m.role, m.role),
                             "content": text_of(m.content, f"messages.{i}.content")}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def system_reminder(text: str) -> str:
    return f"<system-reminder>\n{text}\n</system-reminder>"


def fold_system_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Leading system messages as one; each later one as `<system-reminder>` text where it stands: added to the
    user or tool message before it, else (after an assistant turn) a user turn of its own. Empty ones are dropped.

    Agents put system messages inside a conversation (Claude Code's mid-conversation reminders, Codex's developer
    messages), while most chat templates take a system message only first and raise otherwise; Claude Code itself
    falls back to this folding against servers that refuse them. The place depends only on what comes before, so
    a later turn's prompt extends this one's and the prefix cache serves it.
    """
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out: List[Dict[str, Any]] = []
    lead_text = _joined(*(m["content"] for m in messages[:lead]))
    if lead_text:
        out.append({"role": "system", "content": lead_text})
    for m in messages[lead:]:
        if m["role"] != "system":
            out.append(m)
        elif m["content"]:
            note = system_reminder(m["content"])
            if out and out[-1]["role"] in ("user", "tool") and not out[-1].get("tool_calls"):
                out[-1] = dict(out[-1], content=_joined(out[-1]["content"], note))
            else:
                out.append({"role": "user", "content": note})
    return out


def _joined(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def _render(tokenizer, messages, tools, kwargs, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def chat_prompt(tokenizer, messages: List[Dict[str, Any]], tools: Optional[list] = None,
                template_kwargs: Optional[Dict[str, Any]] = None, tool_choice: Optional[ToolChoice] = None) -> Prompt:
    """Render and encode a conversation the way `mlx_lm.generate` does (template text, no extra special tokens).
    A `tool_choice` that forces a call starts the assistant turn with it (server/tools.py)."""
    with tokenizer_lock(tokenizer):  # the worker thread detokenizes with the same tokenizer
        return _chat_prompt(tokenizer, messages, tools, template_kwargs, tool_choice)


def _chat_prompt(tokenizer, messages, tools, template_kwargs, tool_choice) -> Prompt:
    kwargs = dict(template_kwargs or {})
    if not getattr(tokenizer, "has_chat_template", False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        forced = forced_start(tokenizer, tool_choice, text) if tool_choice else None
        text += forced.text if forced else ""
        return Prompt(tokenizer.encode(text), text, forced=forced)
    try:
        text = _render(tokenizer, messages, tools, kwargs, True)
    except Exception as e:  # jinja raises for conversations a template refuses
        raise APIError(400, f"the chat template rejected these messages: {type(e).__name__}: {e}",
                       param="messages") from e
    forced = forced_start(tokenizer, tool_choice, text) if tool_choice else None
    text += forced.text if forced else ""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    # Message ends worth a snapshot: after the leading system messages, and after the last message.
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    boundaries = []
    for k in sorted({n_system, len(messages)} - {0}):
        try:
            prefix = _render(tokenizer, messages[:k], tools, kwargs, False)
        except Exception:
            continue
        if not text.startswith(prefix):
            continue
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids:
            boundaries.append(len(ids))
    return Prompt(tokens, text, boundaries, forced)


def text_prompt(tokenizer, prompt: Any, vocab: int) -> Prompt:
    """A /v1/completions prompt: text (encoded as mlx-lm does) or token ids."""
    with tokenizer_lock(tokenizer):
        return _text_prompt(tokenizer, prompt, vocab)


def _text_prompt(tokenizer, prompt: Any, vocab: int) -> Prompt:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported (n=1)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        tokens = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        return Prompt(tokens, prompt)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
    return Prompt(list(prompt), tokenizer.decode(list(prompt)))
