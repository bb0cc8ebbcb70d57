"""The Responses API's tool kinds, as the chat template sees them and as calls go back to the client.

- `function`: as chat-completions function tools.
- `namespace` (a named group of function tools: Codex's multi-agent tools, MCP servers): each member is offered as
  the function `NAMESPACE__NAME`; its calls go back as `function_call` items with `namespace` and `name` apart.
- `custom` (freeform input, e.g. Codex's `apply_patch` with a grammar): offered as a function with one string
  argument, `input`, whose description carries the format; its calls go back as `custom_tool_call` items.
- Hosted or client-side tools this server cannot offer (`web_search`, `tool_search`, `image_generation`, ...) are
  left out, with one log line, rather than failing the request.

`ToolSet` holds the mapping for one request: `chat_tools` to render, `item` to turn a parsed call into its output
item, and `history_call` to turn a past call item back into a chat-template tool call.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import APIError, json_kind

logger = logging.getLogger("dflash_mlx.server")

SEPARATOR = "__"  # between a namespace and a member's name, as MCP tools are commonly flattened
GRAMMAR_CHARS = 4000  # of a custom tool's grammar shown to the model


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def flat_name(namespace: Optional[str], name: str) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def _function(name: str, description: str, parameters: Any) -> Dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


def _custom_function(tool: Dict[str, Any]) -> Dict[str, Any]:
    description = tool.get("description") or ""
    fmt = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description += (f"\n\nThe input is free text (not JSON) in this {fmt.get('syntax', '')} grammar:\n"
                        + fmt["definition"][:GRAMMAR_CHARS])
    parameters = {"type": "object", "properties": {"input": {"type": "string", "description": "The whole input."}},
                  "required": ["input"]}
    return _function(tool["name"], description, parameters)


@dataclass
class ToolSet:
    """One request's tools: what the template is shown, and how each offered name maps back."""

    chat_tools: List[Dict[str, Any]] = field(default_factory=list)
    kinds: Dict[str, Tuple[str, Optional[str], str]] = field(default_factory=dict)  # flat -> (kind, ns, name)
    dropped: List[str] = field(default_factory=list)

    @classmethod
    def from_request(cls, tools: Optional[List[Dict[str, Any]]]) -> "ToolSet":
        out = cls()
        for i, tool in enumerate(tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            where = f"tools.{i}"
            if kind == "function":
                out._add_function(tool, None, where)
            elif kind == "namespace":
                namespace = tool.get("name")
                if not isinstance(namespace, str) or not namespace:
                    raise APIError(400, f"{where} has no 'name': give each namespace a name", param=f"{where}.name")
                members = tool.get("tools") or []
                if not isinstance(members, list):
                    raise APIError(400, f"'{where}.tools' must be an array of function tools, got "
                                        f"{json_kind(members)}", param=f"{where}.tools")
                for j, member in enumerate(members):
                    if isinstance(member, dict) and member.get("type", "function") == "function":
                        out._add_function(member, namespace, f"{where}.tools.{j}")
                    else:
                        out.dropped.append(f"{namespace}.{member.get('type') if isinstance(member, dict) else member}")
            elif kind == "custom":
                if not isinstance(tool.get("name"), str) or not tool["name"]:
                    raise APIError(400, f"{where} has no 'name': give each custom tool a name", param=f"{where}.name")
                out.chat_tools.append(_custom_function(tool))
                out.kinds[tool["name"]] = ("custom", None, tool["name"])
            else:
                out.dropped.append(str(kind))
        if out.dropped:
            logger.info("tools left out (this server cannot offer them): %s", ", ".join(out.dropped))
        return out

    def _add_function(self, tool: Dict[str, Any], namespace: Optional[str], where: str) -> None:
        if isinstance(tool.get("function"), dict):  # already in chat-completions form
            tool = dict(tool["function"])
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"{where} has no 'name': give each function tool a name", param=f"{where}.name")
        name = flat_name(namespace, tool["name"])
        self.chat_tools.append(_function(name, tool.get("description"), tool.get("parameters")))
        self.kinds[name] = ("function", namespace, tool["name"])

    @property
    def offered(self) -> Optional[List[Dict[str, Any]]]:
        return self.chat_tools or None

    def item(self, call: Dict[str, Any]) -> Dict[str, Any]:
        """A parsed tool call -> its output item (status in_progress; the caller completes it)."""
        flat = call.get("name", "")
        call_id = call.get("id") or new_id("call")
        kind, namespace, name = self.kinds.get(flat, ("function", None, flat))
        arguments = call.get("arguments", {})
        if kind == "custom":
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            text = _custom_input(arguments)
            return {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": call_id,
                    "name": name, "input": text}
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id, "name": name,
                "arguments": arguments}
        if namespace:
            item["namespace"] = namespace
        return item


def _custom_input(arguments: Any) -> str:
    """A custom tool's freeform input from the call the model wrote: its `input`, else its one string value (small
    models rename the argument), else the arguments as JSON."""
    if isinstance(arguments, dict):
        if isinstance(arguments.get("input"), str):
            return arguments["input"]
        strings = [v for v in arguments.values() if isinstance(v, str)]
        if len(arguments) == 1 and strings:
            return strings[0]
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def history_call(item: Dict[str, Any]) -> Optional[Tuple[str, str, Any]]:
    """A past call item -> (call_id, flat name, arguments) for the chat template; None for items that are no
    call. `function_call` (with its `namespace`), `custom_tool_call` (its input as the `input` argument) and
    `local_shell_call` (its action as the arguments of `local_shell`)."""
    kind = item.get("type")
    call_id = item.get("call_id") or item.get("id")
    if kind == "function_call":
        name = item.get("name")
        return call_id, flat_name(item.get("namespace"), name) if isinstance(name, str) else None, \
            item.get("arguments", "{}")
    if kind == "custom_tool_call":
        return call_id, item.get("name"), {"input": item.get("input", "")}
    if kind == "local_shell_call":
        return call_id, "local_shell", item.get("action") or {}
    return None


OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
