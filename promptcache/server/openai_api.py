"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, SamplingParams, TextDelta
from promptcache.server.schemas import ChatCompletionRequest, CompletionRequest
from promptcache.server.state import ServerState


def sampling_from(
    req: ChatCompletionRequest | CompletionRequest, default_max: int
) -> SamplingParams:
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, stop)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") not in ("text", "input_text"):
                    raise ValueError(
                        f"message content part of type {part.get('type')!r} is not supported (text only)"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def usage(fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def finish_reason(fin: Finished) -> str:
    return "length" if fin.reason == "length" else "stop"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def chat_completions(state: ServerState, request: Request, req: ChatCompletionRequest) -> Any:
    params = sampling_from(req, state.default_max_tokens)
    prompt = state.engine.encode_chat(chat_messages(req), req.tools)
    return await _respond(state, request, req, params, prompt, chat=True)


async def completions(state: ServerState, request: Request, req: CompletionRequest) -> Any:
    params = sampling_from(req, 16 if req.max_tokens is None else req.max_tokens)
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        prompt = list(p)  # type: ignore[arg-type]
    else:
        if isinstance(p, list):
            if len(p) != 1:
                raise ValueError("prompt: exactly one prompt per request is supported")
            p = p[0]
        prompt = state.engine.encode_text(str(p))
    return await _respond(state, request, req, params, prompt, chat=False)


async def _respond(
    state: ServerState,
    request: Request,
    req: Any,
    params: SamplingParams,
    prompt: list[int],
    chat: bool,
) -> Any:
    params.validate()
    state.check_prompt(prompt)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = req.model or state.model_id
    obj = "chat.completion" if chat else "text_completion"
    events = state.events(request, prompt, params, state.tenant_of(request, req.user))
    if not req.stream:
        text, fin = "", None
        async for ev in events:
            if isinstance(ev, TextDelta):
                text += ev.text
            elif isinstance(ev, Finished):
                fin = ev
        assert fin is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(fin), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": fin.text}
        else:
            choice["text"] = fin.text
        body = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(fin),
        }
        return JSONResponse(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    first = await anext(events)  # errors before the first event become a 4xx, not a broken stream
    assert isinstance(first, PrefillDone)

    def chunk(delta: dict[str, Any] | None, text: str | None, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = text or ""
        out = {
            "id": rid,
            "object": obj + (".chunk" if chat else ""),
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = None
        return out

    async def stream() -> AsyncIterator[str]:
        yield sse(chunk({"role": "assistant", "content": ""}, "", None))
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield sse(chunk({"content": ev.text}, ev.text, None))
            elif isinstance(ev, Finished):
                yield sse(chunk({}, "", finish_reason(ev)))
                if include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": obj + (".chunk" if chat else ""),
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage(ev),
                        }
                    )
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
