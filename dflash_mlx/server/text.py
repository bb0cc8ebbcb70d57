"""Streaming text handling: stop strings across token boundaries, and splitting the reply into content, reasoning
and tool calls by the tokenizer's markers (`<think>`...`</think>`, `<tool_call>`...`</tool_call>`) or as bare JSON
(server/tools.py).

Both work on text pieces as they arrive and hold back only a tail that could still be the start of a marker, so
clients never see half a stop string or tool-call markup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .tools import ForcedStart, could_be_bare_call, first_bare_calls, parse_bare_calls, tool_names


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Finds the first stop string in a stream of text pieces; text after it is never released."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit: Optional[str] = None

    def feed(self, piece: str, final: bool = False) -> str:
        """The text that is safe to show now; once a stop string is found, `hit` is set and nothing more comes."""
        if self.hit is not None:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        first = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.hit = first[1]
            self.held = ""
            return text[: first[0]]
        keep = 0 if final else _partial_suffix(text, self.stops)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]


@dataclass
class Piece:
    """One part of the reply: kind is "content", "reasoning" or "tool_call" (then `call` is the parsed call)."""

    kind: str
    text: str = ""
    call: Optional[dict] = None


@dataclass
class _Marker:
    start: str
    end: str
    kind: str


class OutputRouter:
    """Splits the reply text into content, reasoning and tool calls.

    `think` and `tool` are (start, end) marker pairs or None; `parse_tool(text, tools)` turns the text between the
    tool markers into a call dict (or a list of them). `in_reasoning` starts inside a reasoning block (the prompt
    ended with an open `<think>`). With `bare_names`, a reply that is nothing but bare-JSON calls naming one of
    them is returned as calls (its content is held back while it may still be one). `forced` starts the reply
    inside a call whose text so far is `forced.call_text` (a `tool_choice` that forces a call).
    """

    def __init__(self, think: Optional[Tuple[str, str]] = None, tool: Optional[Tuple[str, str]] = None,
                 parse_tool: Optional[Callable[[str, Any], Any]] = None, tools: Any = None,
                 in_reasoning: bool = False, bare_names: Optional[Sequence[str]] = None,
                 forced: Optional[ForcedStart] = None):
        self.markers: List[_Marker] = []
        if think and think[0] and think[1]:
            self.markers.append(_Marker(think[0], think[1], "reasoning"))
        tool_marker = None
        if tool and tool[0] and tool[1] and parse_tool is not None:
            tool_marker = _Marker(tool[0], tool[1], "tool_call")
            self.markers.append(tool_marker)
        self.parse_tool = parse_tool
        self.tools = tools
        self.held = ""
        self.block: Optional[_Marker] = None
        if in_reasoning and think:
            self.block = self.markers[0]
        self.tool_text = ""
        self.failed_tools: List[str] = []
        self.bare_names = list(bare_names or [])
        # Content held while the reply may still be a bare-JSON call; None once it cannot be.
        self.bare: Optional[str] = "" if self.bare_names else None
        self.bare_forced = False
        if forced is not None and forced.markup and tool_marker is not None:
            self.block, self.tool_text, self.bare = tool_marker, forced.call_text, None
        elif forced is not None:
            self.bare, self.bare_forced = forced.call_text, True

    def feed(self, piece: str, final: bool = False) -> List[Piece]:
        out: List[Piece] = []
        text = self.held + piece
        self.held = ""
        while text:
            if self.block is None:
                starts = [(text.find(m.start), m) for m in self.markers]
                starts = [(i, m) for i, m in starts if i >= 0]
                if starts:
                    i, marker = min(starts, key=lambda x: x[0])
                    self._emit(out, "content", text[:i])
                    text = text[i + len(marker.start):]
                    self.block = marker
                    continue
                keep = 0 if final else _partial_suffix(text, [m.start for m in self.markers])
                self._emit(out, "content", text[: len(text) - keep])
                self.held = text[len(text) - keep:] if keep else ""
                break
            i = text.find(self.block.end)
            if i >= 0:
                self._inside(out, text[:i], closed=True)
                text = text[i + len(self.block.end):]
                self.block = None
                continue
            keep = 0 if final else _partial_suffix(text, [self.block.end])
            self._inside(out, text[: len(text) - keep], closed=False)
            self.held = text[len(text) - keep:] if keep else ""
            break
        if final and self.block is not None and self.block.kind == "tool_call" and self.tool_text:
            self._finish_tool(out)  # the reply ended inside a tool call: try to parse what came
            self.block = None
        if final and self.bare is not None:
            self._finish_bare(out)
        return out

    def _emit(self, out: List[Piece], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "content" and self.bare is not None:
            self.bare += text
            if self.bare_forced or could_be_bare_call(self.bare):
                return
            text, self.bare = self.bare, None
        elif self.bare and self.bare.strip():  # reasoning after held content: that content was no call
            self._release_bare(out)
        elif self.bare:  # only whitespace before the reasoning: a call may still follow it
            out.append(Piece("content", self.bare))
            self.bare = ""
        out.append(Piece(kind, text))

    def _release_bare(self, out: List[Piece]) -> None:
        held, self.bare = self.bare, None
        if held:
            out.append(Piece("content", held))

    def _calls(self, out: List[Piece], parsed: Any) -> None:
        self._release_bare(out)  # markup calls: the reply is no bare-JSON call
        for call in parsed if isinstance(parsed, list) else [parsed]:
            out.append(Piece("tool_call", call=call))

    def _finish_bare(self, out: List[Piece]) -> None:
        held, self.bare = self.bare, None
        calls, rest = parse_bare_calls(held, self.bare_names), ""
        if calls is None and self.bare_forced:
            calls, rest = first_bare_calls(held, self.bare_names)
        if calls is None:
            self._emit(out, "content", held)
            return
        self._calls(out, calls)
        self._emit(out, "content", rest)

    def _inside(self, out: List[Piece], text: str, closed: bool) -> None:
        if self.block.kind == "reasoning":
            self._emit(out, "reasoning", text)
            return
        self.tool_text += text
        if closed:
            self._finish_tool(out)

    def _finish_tool(self, out: List[Piece]) -> None:
        raw, self.tool_text = self.tool_text, ""
        try:
            parsed = self.parse_tool(raw, self.tools)
        except Exception:  # a malformed call is shown as text rather than lost
            self.failed_tools.append(raw)
            self._release_bare(out)
            self._emit(out, "content", raw)
            return
        self._calls(out, parsed)


def router_for(tokenizer, prompt_text: str, tools: Any, forced: Optional[ForcedStart] = None) -> OutputRouter:
    """The router for a reply to `prompt_text` (which ends with `forced.text` when a call is forced) with this
    tokenizer's markers (mlx-lm's `TokenizerWrapper`)."""
    think = None
    if getattr(tokenizer, "has_thinking", False):
        think = (tokenizer.think_start, tokenizer.think_end)
    tool = None
    parse = getattr(tokenizer, "tool_parser", None)
    if tools and getattr(tokenizer, "has_tool_calling", False) and parse is not None:
        tool = (tokenizer.tool_call_start, tokenizer.tool_call_end)
    in_reasoning = False
    if think:
        in_reasoning = prompt_text.rfind(think[0]) > prompt_text.rfind(think[1])
    return OutputRouter(think, tool, parse, tools, in_reasoning, bare_names=tool_names(tools), forced=forced)
