"""Generated requests for fuzzing the server, shared by tests/test_server_fuzz.py and benchmarks/server_fuzz.py.

Two sources: schemathesis, from the server's own /openapi.json (valid and invalid bodies for every operation), and
hypothesis strategies here for what that schema leaves open: Anthropic message bodies (content blocks of every
kind, tool results holding any JSON) and Responses bodies (input items of every kind, tools, namespaces).
Every generated body asks for at most 2 tokens, so a run costs requests, not decoding.

`check(path, response, log)` is the verdict on one answer: no 5xx, no traceback logged, an error in the route's
own dialect whose message says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from hypothesis import strategies as st

LIMITS = ("max_tokens", "max_output_tokens", "max_completion_tokens")

_text = st.text(max_size=12)
_number = st.integers(-2, 2**40) | st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
_json = st.recursive(st.none() | st.booleans() | _number | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=8)


def _maybe(**fields) -> st.SearchStrategy:
    """A dict holding any subset of `fields` (each drawn from its strategy)."""
    return st.fixed_dictionaries({}, optional=fields)


def _block_of(kind: str, **fields) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just(kind)}, optional=fields)


_anthropic_block = st.one_of(
    _block_of("text", text=_text | _json),
    _block_of("image", source=_json),
    _block_of("tool_use", id=_text, name=_text | _json, input=_json),
    _block_of("tool_result", tool_use_id=_text, content=_json | st.lists(_block_of("text", text=_text), max_size=2),
              is_error=st.booleans()),
    _block_of("thinking", thinking=_text, signature=_text),
    _block_of("document", source=_json),
    st.dictionaries(_text, _json, max_size=2),
)
_anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": _text | st.lists(_anthropic_block, min_size=1, max_size=3)})
_odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | _json},
    optional={"content": _text | st.lists(_anthropic_block, max_size=3) | _json})
_anthropic_tool = _maybe(name=_text | _json, description=_text, input_schema=_json, type=_text)
_anthropic_options = dict(
    model=_text, system=_text | st.lists(_block_of("text", text=_text), max_size=2) | _json,
    stream=st.booleans() | st.none(), stop_sequences=st.lists(_text, max_size=2) | _json,
    temperature=st.floats(0, 2) | _json, tools=st.lists(_anthropic_tool, max_size=2) | _json,
    tool_choice=_maybe(type=st.sampled_from(["auto", "any", "tool", "none"]) | _text, name=_text) | _json,
    thinking=_maybe(type=st.sampled_from(["enabled", "disabled"]) | _text, budget_tokens=_json),
    metadata=_json)


def anthropic_bodies() -> st.SearchStrategy:
    """/v1/messages and count_tokens bodies: most well-formed around odd parts (content blocks of every kind,
    tool results holding any JSON), some odd throughout."""
    well_formed = st.fixed_dictionaries(
        {"messages": st.lists(_anthropic_message, min_size=1, max_size=4), "max_tokens": st.integers(1, 2)},
        optional=_anthropic_options)
    odd = _maybe(messages=st.lists(_odd_message, max_size=4) | _json, max_tokens=st.integers(-1, 2) | _json,
                 **_anthropic_options)
    return st.one_of(well_formed, well_formed, odd)


_part = st.one_of(_block_of("input_text", text=_text | _json), _block_of("output_text", text=_text),
                  _block_of("input_image", image_url=_text), _json)
_user_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                                       "content": _text | st.lists(_part, min_size=1, max_size=3)},
                                      optional={"type": st.just("message")})
_responses_item = st.one_of(
    _user_message,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]) | _json},
                          optional={"type": st.just("message"), "content": _text | st.lists(_part, max_size=3)
                                    | _json}),
    _block_of("function_call", call_id=_text | _json, name=_text | _json, arguments=_text | _json,
              namespace=_text | _json),
    _block_of("function_call_output", call_id=_text | _json, output=_text | _json),
    _block_of("custom_tool_call", call_id=_text, name=_text, input=_text | _json),
    _block_of("custom_tool_call_output", call_id=_text, output=_text | _json),
    _block_of("local_shell_call", call_id=_text, action=_json),
    _block_of("local_shell_call_output", call_id=_text, output=_json),
    _block_of("reasoning", summary=_json),
    st.dictionaries(_text, _json, max_size=2),
)
_responses_tool = st.one_of(
    _block_of("function", name=_text | _json, description=_text, parameters=_json),
    _block_of("namespace", name=_text | _json, tools=st.lists(_block_of("function", name=_text), max_size=2)
              | _json),
    _block_of("custom", name=_text | _json, format=_json),
    _block_of("web_search"), _json)
_responses_options = dict(
    model=_text, instructions=_text | _json, previous_response_id=_text | _json, store=st.booleans() | st.none(),
    stream=st.booleans() | st.none(), tools=st.lists(_responses_tool, max_size=3) | _json,
    tool_choice=st.sampled_from(["auto", "none", "required"]) | _maybe(type=_text, name=_text) | _json,
    text=_maybe(format=_maybe(type=_text)) | _json, reasoning=_json, metadata=_json, temperature=_json)


def responses_bodies() -> st.SearchStrategy:
    """/v1/responses bodies: most start with a message and hold input items and tools of every kind."""
    well_formed = st.fixed_dictionaries(
        {"input": _text | st.builds(lambda first, rest: [first] + rest, _user_message,
                                    st.lists(_responses_item, max_size=3)),
         "max_output_tokens": st.integers(1, 2)}, optional=_responses_options)
    odd = _maybe(input=_text | st.lists(_responses_item, max_size=4) | _json,
                 max_output_tokens=st.integers(-1, 2), **_responses_options)
    return st.one_of(well_formed, well_formed, odd)


def bounded(path: str, body: Any) -> Any:
    """A generated body made cheap to serve: at most 2 tokens asked for (a missing limit set to 2; invalid values,
    which are refused anyway, left as they are)."""
    if not isinstance(body, dict):
        return body
    for key in LIMITS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[key] = 2
    if path in ("/v1/chat/completions", "/v1/completions") and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 2
    return body


def problems(path: str, status: int, text: str) -> List[str]:
    """What is wrong with one answer (an empty list: nothing)."""
    out = []
    if status >= 500 and status != 503:
        out.append(f"{status} from {path}: {text[:300]}")
    if "Traceback" in text:
        out.append(f"a traceback in the answer from {path}")
    if status >= 400 and path.startswith("/v1/"):
        try:
            body = json.loads(text)
        except ValueError:
            return out + [f"{status} from {path} is not JSON: {text[:200]}"]
        message = _message(path, body)
        if message is None:
            out.append(f"{status} from {path} is not in the route's dialect: {text[:300]}")
        elif status == 400 and not _names_what(message):
            out.append(f"400 from {path} does not say what is wrong: {message!r}")
    return out


def _message(path: str, body: Any) -> Optional[str]:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    if path.startswith("/v1/messages"):
        ok = body.get("type") == "error" and set(error) == {"type", "message"}
    else:
        ok = set(error) == {"message", "type", "param", "code"}
    return error["message"] if ok and isinstance(error.get("message"), str) and error["message"] else None


def _names_what(message: str) -> bool:
    """A 400's message names a field (quoted) or the body, or says what the request lacks or holds."""
    return "'" in message or "body" in message or "prompt" in message or "messages" in message or \
        "input" in message or "context" in message


def traceback_lines(records: List[str]) -> List[str]:
    return [r for r in records if "Traceback (most recent call last)" in r]
