"""Anthropic-compatible endpoint: /v1/messages (so Claude Code and the anthropic client work)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, SamplingParams, TextDelta
from promptcache.server.schemas import MessagesRequest
from promptcache.server.state import ServerState


def _text_of(block: dict[str, Any]) -> str:
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return json.dumps(
            {"tool_use": {"name": block.get("name"), "input": block.get("input", {})}}
        )
    if kind == "tool_result":
        inner = block.get("content", "")
        if isinstance(inner, list):
            inner = "".join(_text_of(b) for b in inner)
        return str(inner)
    raise ValueError(
        f"content block of type {kind!r} is not supported (text, tool_use, tool_result)"
    )


def to_chat(req: MessagesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages: list[dict[str, Any]] = []
    if req.system:
        system = (
            req.system if isinstance(req.system, str) else "".join(b.text or "" for b in req.system)
        )
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        results = [b for b in m.content if b.get("type") == "tool_result"]
        others = [b for b in m.content if b.get("type") != "tool_result"]
        for b in results:
            messages.append(
                {"role": "tool", "content": _text_of(b), "tool_call_id": b.get("tool_use_id")}
            )
        if others or not results:
            messages.append({"role": m.role, "content": "".join(_text_of(b) for b in others)})
    tools = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    return messages, tools


def stop_info(fin: Finished) -> tuple[str, str | None]:
    if fin.reason == "length":
        return "max_tokens", None
    if fin.stop_sequence is not None:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def usage(fin: Finished) -> dict[str, int]:
    return {
        "input_tokens": fin.prompt_tokens - fin.cached_tokens,
        "output_tokens": fin.completion_tokens,
        "cache_read_input_tokens": fin.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def messages(state: ServerState, request: Request, req: MessagesRequest) -> Any:
    msgs, tools = to_chat(req)
    stops = list(req.stop_sequences or [])
    params = SamplingParams(req.max_tokens, req.temperature, req.top_p, req.top_k, None, stops)
    params.validate()
    prompt = state.engine.encode_chat(msgs, tools)
    state.check_prompt(prompt)
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = req.model or state.model_id
    events = state.events(request, prompt, params, state.tenant_of(request))
    if not req.stream:
        fin = None
        async for ev in events:
            if isinstance(ev, Finished):
                fin = ev
        assert fin is not None
        reason, seq = stop_info(fin)
        return JSONResponse(
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": fin.text}],
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": usage(fin),
            }
        )

    first = await anext(events)
    assert isinstance(first, PrefillDone)

    async def stream() -> AsyncIterator[str]:
        start_usage = {
            "input_tokens": first.prompt_tokens - first.cached_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": first.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
        message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": start_usage}  # fmt: skip
        yield event("message_start", {"message": message})
        yield event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        yield event("ping", {})
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield event(
                    "content_block_delta",
                    {"index": 0, "delta": {"type": "text_delta", "text": ev.text}},
                )
            elif isinstance(ev, Finished):
                reason, seq = stop_info(ev)
                yield event("content_block_stop", {"index": 0})
                yield event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": ev.completion_tokens},
                    },
                )
                yield event("message_stop", {})

    return StreamingResponse(stream(), media_type="text/event-stream")
