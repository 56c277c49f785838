"""Model metadata: ``/v1/models`` and ``/v1/models/{id}`` in one shape that the OpenAI and
Anthropic clients both read (their fields do not collide), with the context length under the
names clients look for: ``context_length`` (LM Studio, OpenRouter), ``max_model_len`` (vLLM),
``max_input_tokens`` (Anthropic); the engine and the capabilities.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request

from promptcache.server.routes import ApiRoute
from promptcache.server.state import ServerState

CREATED = 0  # unknown release date: the epoch, as both APIs allow


def capabilities(state: ServerState) -> dict[str, bool]:
    formatter = state.formatter
    return {
        "completion": True,
        "tools": True,  # native template tools, or the fallback prompt (tools/registry.py)
        "vision": state.image_policy.enabled,
        "reasoning": formatter.reasoning.name != "none",
        "json_schema": True,
    }


def anthropic_capabilities(caps: dict[str, bool]) -> dict[str, Any]:
    """The same capabilities in the shape of Anthropic's ``ModelCapabilities``."""

    def yes(value: bool) -> dict[str, bool]:
        return {"supported": value}

    no = yes(False)
    return {
        "batch": no, "citations": no, "code_execution": no, "pdf_input": no,
        "context_management": {"supported": False},
        "effort": {"supported": False, "low": no, "medium": no, "high": no, "max": no},
        "image_input": yes(caps["vision"]),
        "server_tools": {"supported": False, "code_execution": no, "web_search": no},
        "structured_outputs": yes(caps["json_schema"]),
        "thinking": {"supported": caps["reasoning"],
                     "types": {"enabled": yes(caps["reasoning"]), "adaptive": no,
                               "between_tools": no, "disabled": yes(True)}},
    }  # fmt: skip


def model_card(
    state: ServerState, model_id: str | None = None, anthropic: bool = False
) -> dict[str, Any]:
    """One model, for either client: OpenAI's (object, created, owned_by) and vLLM's fields,
    Anthropic's (type, display_name, created_at, max_input_tokens, max_tokens). ``anthropic``
    (the request has an ``anthropic-version`` header): capabilities in Anthropic's shape."""
    context = state.engine_limits.max_context
    name = model_id or state.model_id
    max_out = min(state.max_output_tokens or context, context)
    caps = capabilities(state)
    return {
        "id": name,
        "object": "model",
        "created": CREATED,
        "owned_by": "promptcache",
        "root": state.model_id,
        "parent": None,
        "max_model_len": context,
        "context_length": context,
        "engine": state.engine.name,
        "capabilities": anthropic_capabilities(caps) if anthropic else caps,
        "tool_format": state.formatter.tool_format,
        "reasoning_format": state.formatter.reasoning.name,
        "type": "model",
        "display_name": name,
        "created_at": datetime.fromtimestamp(CREATED, timezone.utc)
        .isoformat()
        .replace("+00:00", "Z"),
        "lifecycle": "active",
        "max_input_tokens": context,
        "max_tokens": max_out,
    }


def list_models(state: ServerState, anthropic: bool = False) -> dict[str, Any]:
    card = model_card(state, anthropic=anthropic)
    return {
        "object": "list",
        "data": [card],
        "first_id": card["id"],  # Anthropic's page fields: one page
        "last_id": card["id"],
        "has_more": False,
    }


async def models(state: ServerState, request: Request) -> dict[str, Any]:
    return list_models(state, "anthropic-version" in request.headers)


async def model(state: ServerState, request: Request, model_id: str) -> dict[str, Any]:
    return model_card(state, model_id, "anthropic-version" in request.headers)


ROUTES = (
    ApiRoute("/v1/models", models, methods=("GET",), doc="The served model with its context "
             "length, engine and capabilities (OpenAI's list and Anthropic's page in one body)."),
    ApiRoute("/v1/models/{model_id:path}", model, methods=("GET",), doc="Any id names the "
             "served model (requests are served whatever ``model`` says)."),
)  # fmt: skip
