"""The OpenAI API's bodies: chat completions and completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from promptcache.server.schemas import Loose


class ChatMessage(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, sent back


class StreamOptions(Loose):
    include_usage: bool = False


class Sampling(Loose):
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


class ChatCompletionRequest(Sampling):
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


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False
