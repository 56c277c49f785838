"""The Anthropic Messages API's bodies: messages and count_tokens."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from promptcache.server.schemas import Loose


class AnthropicBlock(Loose):
    type: str
    text: str | None = None


class AnthropicMessage(Loose):
    role: Literal["user", "assistant", "system"]  # "system" anywhere: Claude Code sends it
    content: str | list[dict[str, Any]]


class AnthropicTool(Loose):
    """A client tool (no type, or ``custom``) or a server tool (``web_search_20250305``...; set
    aside: ``tool_kinds``), whose other fields are the vendor's."""

    type: str | None = None
    name: str = ""
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class CountTokensRequest(Loose):
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
