"""Request bodies of the OpenAI and Anthropic endpoints, as pydantic models.

Unknown fields are accepted and ignored (clients send many); known fields are type-checked, and a wrong type is
a 400 in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


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
    role: Literal["system", "developer", "user", "assistant", "tool"]
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
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    logit_bias: Optional[Dict[str, float]] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[int], List[str]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
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
    stream: bool = False
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None


class AnthropicCountRequest(_Lenient):
    model: Optional[str] = None
    messages: List[AnthropicMessage]
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
