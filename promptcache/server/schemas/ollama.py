"""The Ollama API's bodies: chat, generate, show."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from promptcache.server.schemas import Loose


class OllamaMessage(Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None  # base64, no data-URL prefix
    tool_calls: list[dict[str, Any]] | None = None  # [{function: {name, arguments: {...}}}]
    tool_name: str | None = None  # a tool result's tool
    thinking: str | None = None  # an earlier reply's reasoning, sent back


class OllamaBase(Loose):
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


class OllamaShowRequest(Loose):
    model: str = ""
    name: str | None = None  # the older field name
    verbose: bool = False
