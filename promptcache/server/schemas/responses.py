"""The OpenAI Responses API's body."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from promptcache.server.schemas import Loose


class ResponsesRequest(Loose):
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
