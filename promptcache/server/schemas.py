"""Request bodies at the HTTP edge (pydantic). Unknown fields are accepted and ignored; known
fields are strictly typed (``"max_tokens": "8"`` is a 400, not 8)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, sent back


class StreamOptions(_Loose):
    include_usage: bool = False


class _Sampling(_Loose):
    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's cache routing key: our session id
    ignore_eos: bool = False  # vLLM's extension: every reply max_tokens long (load generators)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # passed to the chat template (vLLM / SGLang's extra body): enable_thinking and the like
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None  # gpt-oss' template reads it (low, medium, high)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False


class AnthropicBlock(_Loose):
    type: str
    text: str | None = None


class AnthropicMessage(_Loose):
    role: Literal["user", "assistant", "system"]  # "system" anywhere: Claude Code sends it
    content: str | list[dict[str, Any]]


class AnthropicTool(_Loose):
    """A client tool (no type, or ``custom``) or a server tool (``web_search_20250305``...; set
    aside: ``tool_kinds``), whose other fields are the vendor's."""

    type: str | None = None
    name: str = ""
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class CountTokensRequest(_Loose):
    """A Messages request without sampling: what /v1/messages/count_tokens takes. Fields a
    local model has no use for (cache_control, metadata, thinking, context_management,
    output_config's effort, beta headers) are accepted and ignored."""

    model: str = ""
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {type: disabled} turns the template's thinking off


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None


class ResponsesRequest(_Loose):
    """``POST /v1/responses``. ``input``: text or items (messages, function calls and their
    outputs, reasoning); ``include``, ``truncation``, ``service_tier``, ``background: false``
    and the like are accepted and ignored."""

    model: str = ""
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


class OllamaMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None  # base64, no data-URL prefix
    tool_calls: list[dict[str, Any]] | None = None  # [{function: {name, arguments: {...}}}]
    tool_name: str | None = None  # a tool result's tool
    thinking: str | None = None  # an earlier reply's reasoning, sent back


class OllamaBase(_Loose):
    """What /api/chat and /api/generate share. ``keep_alive`` is accepted and ignored (the
    model stays loaded); ``options`` beyond the sampling ones are ignored, said in a header."""

    model: str = ""
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class OllamaChatRequest(OllamaBase):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaBase):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None
    suffix: str | None = None
    template: str | None = None


class OllamaShowRequest(_Loose):
    model: str = ""
    name: str | None = None  # the older field name
    verbose: bool = False
