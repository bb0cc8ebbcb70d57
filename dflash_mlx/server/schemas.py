"""Request bodies of the OpenAI (chat, completions, responses) and Anthropic endpoints, as pydantic models, and `check_text`, the checks every
body's text gets before anything renders or tokenizes it.

Unknown fields are accepted and ignored (clients send many); known fields are type-checked, and a wrong type is
a 400 in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import APIError, ContextTooLong


class _Lenient(BaseModel):
    """Unknown fields allowed; a null for one of `NULL_IS_DEFAULT` (OpenAI's spec lets clients send null for
    them) is read as the field's default."""

    model_config = ConfigDict(extra="allow")
    NULL_IS_DEFAULT: ClassVar[Tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False


class FunctionCall(_Lenient):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCall(_Lenient):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    # "function": the result of a call in OpenAI's older function-calling form (read as a tool message)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class _Sampling(_Lenient):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(default=None, gt=0)
    repetition_context_size: Optional[int] = Field(default=None, ge=1)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = 1
    logit_bias: Optional[Dict[str, float]] = None

    NULL_IS_DEFAULT: ClassVar[Tuple[str, ...]] = ("stream", "n", "logprobs", "echo")


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[int], List[str], List[List[int]]]  # a list holds one prompt (n=1)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: Optional[bool] = False


class AnthropicMessage(_Lenient):
    # "system": Claude Code's mid-conversation system messages (beta mid-conversation-system-*)
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Dict[str, Any]]]


class AnthropicRequest(_Lenient):
    model: Optional[str] = None
    max_tokens: int
    messages: List[AnthropicMessage]
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: Optional[bool] = False
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None

    NULL_IS_DEFAULT: ClassVar[Tuple[str, ...]] = ("stream",)


class AnthropicCountRequest(_Lenient):
    model: Optional[str] = None
    messages: List[AnthropicMessage]
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None


class ResponsesRequest(_Lenient):
    """OpenAI's Responses API (`POST /v1/responses`): `input` is a string or a list of items (messages,
    function calls, function call outputs); server/responses_format.py turns them into chat messages."""

    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    seed: Optional[int] = None
    stream: Optional[bool] = False
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    metadata: Optional[Dict[str, Any]] = None
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    NULL_IS_DEFAULT: ClassVar[Tuple[str, ...]] = ("store", "stream", "parallel_tool_calls")


# A prompt's text may take this many UTF-8 bytes per token of the model's context, plus the margin, before it is
# refused unseen. Tokens average about 4 bytes of English (fewer of CJK), so a prompt that fits the context is
# far below; runs of spaces or symbols can reach 16 bytes a token but not over a whole prompt.
BYTES_PER_TOKEN = 8
BYTES_MARGIN = 16 << 10


def text_limit(context_length: Optional[int]) -> Optional[int]:
    """The most bytes of text a request may hold for a model with this context (None: no limit)."""
    return None if context_length is None else context_length * BYTES_PER_TOKEN + BYTES_MARGIN


# The fields that become the prompt: when these hold the bulk of a request over the limit, the prompt is too long
# for the context; when others do (metadata, stop, logit_bias...), that field is too big.
PROMPT_FIELDS = ("messages", "input", "prompt", "system", "instructions", "tools")


def check_text(body: BaseModel, context_length: Optional[int]) -> None:
    """Refuse a body (every field, unknown ones and dict keys included) that holds a lone surrogate, or whose text
    is over `text_limit(context_length)` bytes of UTF-8, with a 400 (or a 413 naming the field, when the bulk
    is not the prompt's); numbers count as their decimal digits.

    JSON lets a client escape half of a surrogate pair ("\\ud800"); Python keeps it, and the tokenizer, the
    chat template or the UTF-8 response would fail on it later with a 500. The size is checked here because
    rendering and tokenizing a 10 MB prompt takes seconds and gigabytes before its token count can refuse it.
    """
    limit = text_limit(context_length)
    sizes: Dict[str, int] = {}  # bytes of text under each top-level field
    stack: List[tuple] = [(body.model_dump(), "", "")]
    while stack:
        value, where, top = stack.pop()
        size = 0
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                if isinstance(key, str):
                    size += _utf8_bytes(key, where or "body", key=True)
                stack.append((item, path, top or str(key)))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{where}.{i}", top) for i, item in enumerate(value))
        elif isinstance(value, str):
            size = _utf8_bytes(value, where)
        elif isinstance(value, (int, float)):
            size = len(repr(value))
        sizes[top] = sizes.get(top, 0) + size
    total = sum(sizes.values())
    if limit is None or total <= limit:
        return
    bulk = max(sizes, key=sizes.get)
    if bulk in PROMPT_FIELDS:
        raise ContextTooLong(f"the request holds more than {limit} bytes of text, more than this model's "
                             f"{context_length}-token context can take ({BYTES_PER_TOKEN} bytes per token, plus "
                             f"{BYTES_MARGIN // 1024} KiB); shorten the messages", None, context_length,
                             param=None)
    raise APIError(413, f"'{bulk}' holds {sizes[bulk]} bytes, and the request {total}, over the {limit} bytes of text "
                        f"this server takes in a request (for its {context_length}-token context); send less in "
                        f"'{bulk}'", param=bulk, code="request_too_large")


def _utf8_bytes(text: str, where: str, key: bool = False) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        # The message names the field, never the text (it could not be sent back as UTF-8 either).
        what = f"a key in '{where}'" if key else f"'{where}'"
        raise APIError(400, f"{what} is not valid Unicode: it holds a lone surrogate (half of a UTF-16 pair, e.g. "
                            "\\ud800); send text as UTF-8, or escape surrogates only in pairs",
                       param=where) from None
