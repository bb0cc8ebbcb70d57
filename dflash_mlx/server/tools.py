"""Tool calls beyond what the tokenizer's parser sees: `tool_choice` that forces a call, and calls a model writes
as bare JSON instead of its template's tool-call markup.

Forcing: after the chat template's generation prompt the assistant turn is started for the model, with the
opening markup of mlx-lm's tool parser for the tokenizer (`<tool_call>` ...) and the start of the call in that
parser's format (`{"name": "NAME", "arguments": ` for a named function, `{"name": "` for any). The reply then
continues the call and is parsed as usual. A tokenizer without a parser, or a parser whose call format is not known here, gets the bare-JSON
form instead, parsed by `parse_bare_calls`.

Bare JSON: some models (qwen2.5-coder) answer a tools request with `{"name": ..., "arguments": {...}}`, a list of
them, or either fenced in a ```json block. When the whole reply is such a call naming an offered tool, it is one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import APIError

# The start of a call, per mlx-lm tool parser (module name -> format): naming `name`, or (None) any function.
_CALL_START = {
    "json_tools": lambda name: '{"name": ' + json.dumps(name) + ', "arguments": ' if name else '{"name": "',
    "qwen3_coder": lambda name: f"<function={name}>\n" if name else "<function=",
}
_BARE_START = _CALL_START["json_tools"]


def tool_names(tools: Optional[Sequence[Dict[str, Any]]]) -> List[str]:
    names = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


@dataclass
class ToolChoice:
    """What `tool_choice` asks for: mode "none", "auto", "required" or "named" (then `name`)."""

    mode: str = "auto"
    name: Optional[str] = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def openai_tool_choice(choice: Any, tools: Optional[list]) -> ToolChoice:
    """OpenAI's `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function": {"name": ...}})."""
    if choice is None:
        return ToolChoice("auto")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        result = ToolChoice(choice)
    else:
        function = choice.get("function") if choice.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': NAME}}", param="tool_choice")
        result = ToolChoice("named", name)
    return _checked(result, tools)


def anthropic_tool_choice(choice: Optional[Dict[str, Any]], tools: Optional[list]) -> ToolChoice:
    """Anthropic's `tool_choice` ({"type": "auto" | "any" | "tool" (with "name") | "none"})."""
    kind = (choice or {}).get("type", "auto")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice of type 'tool' needs a 'name'", param="tool_choice")
        return _checked(ToolChoice("named", choice["name"]), tools)
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in modes:
        raise APIError(400, f"tool_choice type {kind!r} is not one of 'auto', 'any', 'tool' or 'none'",
                       param="tool_choice")
    return _checked(ToolChoice(modes[kind]), tools)


def _checked(choice: ToolChoice, tools: Optional[list]) -> ToolChoice:
    if not choice.forced:
        return choice
    names = tool_names(tools)
    if not names:
        raise APIError(400, f"tool_choice '{choice.mode}' needs 'tools' to choose from", param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise APIError(400, f"tool_choice names the function '{choice.name}', which is not in 'tools' "
                            f"({', '.join(names)})", param="tool_choice")
    return choice


@dataclass
class ForcedStart:
    """How a forced call begins: `text` goes after the generation prompt; the router starts inside a call whose
    text so far is `call_text` (in the parser's markup when `markup`, else bare JSON)."""

    text: str
    call_text: str
    markup: bool


def _parser_format(tokenizer) -> Optional[str]:
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1] or None


def forced_start(tokenizer, choice: ToolChoice, prompt_text: str) -> Optional[ForcedStart]:
    """The assistant-turn start that forces the call `choice` asks for (None when it forces none)."""
    if not choice.forced:
        return None
    lead = ""
    think_start, think_end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if getattr(tokenizer, "has_thinking", False) and prompt_text.rfind(think_start) > prompt_text.rfind(think_end):
        lead = think_end + "\n\n"  # the prompt opened a reasoning block: close it, the call comes now
    markup = getattr(tokenizer, "tool_call_start", None)
    fmt = _parser_format(tokenizer)
    has_parser = bool(getattr(tokenizer, "has_tool_calling", False) and markup
                      and getattr(tokenizer, "tool_call_end", None) and getattr(tokenizer, "tool_parser", None))
    if has_parser and (choice.mode == "required" or fmt in _CALL_START):
        template = str(getattr(tokenizer, "chat_template", None) or "")
        # As the template writes it (Qwen: "<tool_call>\n{...}\n</tool_call>").
        gap = "\n" if markup + "\\n" in template or markup + "\n" in template else ""
        # Where the format is known the call itself is begun too: after the bare markup a model may still
        # end its turn or write prose.
        call = _CALL_START[fmt](choice.name) if fmt in _CALL_START else ""
        return ForcedStart(lead + markup + gap + call, call, markup=True)
    call = _BARE_START(choice.name)
    return ForcedStart(lead + call, call, markup=False)


def _strip_fence(text: str) -> str:
    s = text.strip()
    if s.startswith("```"):
        newline = s.find("\n")
        s = s[newline + 1:] if newline >= 0 else ""
        if s.rstrip().endswith("```"):
            s = s.rstrip()[:-3]
    return s.strip()


def _call(obj: Any, names: Sequence[str]) -> Optional[Dict[str, Any]]:
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters", "id", "type"}:
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if name not in names or not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": arguments}


def parse_bare_calls(text: str, names: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
    """The calls in a reply that is nothing but bare-JSON tool calls naming offered tools; else None."""
    try:
        value = json.loads(_strip_fence(text))
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def first_bare_calls(text: str, names: Sequence[str]) -> Tuple[Optional[List[Dict[str, Any]]], str]:
    """A forced call followed by more text: the calls of the leading JSON value, and the text after it."""
    s = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return None, ""
    calls = parse_bare_calls(json.dumps(value), names)
    return (calls, s[end:]) if calls is not None else (None, "")


def could_be_bare_call(text: str) -> bool:
    """Whether `text` may still grow into a bare-JSON call (so a streamed reply holds it back until it knows)."""
    s = text.lstrip()
    if s.startswith("```"):
        newline = s.find("\n")
        if newline < 0:
            return s[3:].strip() in ("", "j", "js", "jso", "json")
        if s[3:newline].strip() not in ("", "json"):
            return False
        s = s[newline + 1:].lstrip()
    elif "```".startswith(s):
        return True
    first = s[1:].lstrip() if s.startswith("[") else s
    if not first:
        return True
    if first[0] != "{":
        return False
    body = first[1:].lstrip()
    if not any(body.startswith(k) or k.startswith(body) for k in ('"name"', '"arguments"', '"parameters"')):
        return False
    # A complete JSON value followed by more than a closing fence is not a whole-reply call.
    try:
        _, end = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return True
    return s[end:].strip().strip("`").strip() == ""
