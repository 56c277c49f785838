"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError, SamplingParams
from promptcache.server import pipeline
from promptcache.server.chat import Chat
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, image_part, openai_image
from promptcache.server.pipeline import Generation, Reply
from promptcache.server.routes import SSE, ApiRoute
from promptcache.server.schemas.openai import ChatCompletionRequest, CompletionRequest
from promptcache.server.sessions import session_of
from promptcache.server.state import ServerState
from promptcache.server.tool_kinds import function_tools

log = logging.getLogger("promptcache.server")


def sampling_from(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, stop)
    params.ignore_eos = req.ignore_eos
    return params


def chat_messages(
    req: ChatCompletionRequest, images: ImagePolicy = TEXT_ONLY
) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                kind = part.get("type")
                if kind == "image_url" and m.role == "user":
                    parts.append(image_part(openai_image(part, images)))
                    continue
                if kind in ("image_url", "input_image", "input_audio", "file"):
                    what = "image" if kind == "image_url" and images.enabled else "part"
                    raise RequestError(
                        f"message content parts of type {kind!r} are not supported here: "
                        + ("images go in user messages" if what == "image" else
                           "this server takes text and, on vision models, image_url data URLs")
                    )  # fmt: skip
                if kind not in ("text", "input_text"):
                    raise RequestError(
                        f"message content part of type {kind!r} is not supported (text only)"
                    )
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            # text only: one string (what every chat template takes); with images, the parts
            if any(p["type"] == "image" for p in parts):
                content = parts
            else:
                content = "".join(p["text"] for p in parts)
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content and m.role == "assistant":
            msg["reasoning_content"] = m.reasoning_content
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def to_chat(req: ChatCompletionRequest, images: ImagePolicy = TEXT_ONLY) -> Chat:
    tools, ignored = function_tools(req.tools, "chat completions")
    chat = Chat(chat_messages(req, images), tools)
    chat.ignored_tools = ignored
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if not name:
            raise RequestError("tool_choice: a named choice needs function.name")
        chat.tool_choice, chat.tool_name = "named", name
    elif choice in ("auto", "none", "required"):
        chat.tool_choice = choice
    else:
        raise RequestError(
            f"tool_choice must be none, auto, required or a named function, not {choice!r}"
        )
    chat.parallel_tool_calls = req.parallel_tool_calls
    kwargs = req.chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object")
    chat.template_kwargs = dict(kwargs or {})
    if req.enable_thinking is not None:
        chat.template_kwargs["enable_thinking"] = req.enable_thinking
    if req.reasoning_effort is not None:
        chat.template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    fmt = req.response_format or {"type": "text"}
    inner = fmt.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else None
    apply_format(
        chat, fmt.get("type"), schema, "response_format", "response_format.json_schema.schema"
    )
    return chat


def usage(fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def finish_reason(fin: Finished, reply: Reply) -> str:
    if reply.calls and fin.reason != "cancelled":
        return "tool_calls"
    return "length" if fin.reason in ("length", "context", "timeout") else "stop"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for cid, c in reply.calls
    ]


async def chat_completions(state: ServerState, request: Request, req: ChatCompletionRequest) -> Any:
    asked = req.max_completion_tokens or req.max_tokens
    explicit = asked is not None
    params = sampling_from(req, state.output_budget(asked))
    params.session = session_of(request, req.prompt_cache_key, req.user)
    chat = to_chat(req, state.image_policy)
    gen = await pipeline.open_chat(state, request, chat, params, explicit)
    return await _respond(gen, req, state.model_id, is_chat=True)


async def completions(state: ServerState, request: Request, req: CompletionRequest) -> Any:
    params = sampling_from(req, state.output_budget(req.max_tokens))
    params.session = session_of(request, req.prompt_cache_key, req.user)
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        prompt = list(p)  # type: ignore[arg-type]
        vocab = state.engine_limits.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt: token ids must be in [0, {vocab}) for this model")
    else:
        if isinstance(p, list):
            if len(p) != 1:
                raise RequestError("prompt: exactly one prompt per request is supported")
            p = p[0]
        prompt = await run_in_threadpool(state.engine.encode_text, str(p))
    tenant = state.tenant_of(request, req.user)
    explicit = req.max_tokens is not None
    gen = pipeline.open_prompt(state, request, prompt, params, tenant, explicit)
    return await _respond(gen, req, state.model_id, is_chat=False)


def apply_format(chat: Chat, kind: Any, schema: Any, field: str, schema_field: str) -> None:
    """Constrain chat's reply by an OpenAI output format of type text (free), json_object or
    json_schema (`schema`); field and schema_field name the request's fields in errors."""
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise RequestError(f"{schema_field} must be a JSON schema object")
        chat.response_schema = schema
    elif kind == "json_object":
        chat.response_schema = {"type": "object"}
    elif kind != "text":
        raise RequestError(f"{field}.type must be text, json_object or json_schema, not {kind!r}")


async def _respond(gen: Generation, req: Any, model_id: str, is_chat: bool) -> Any:
    rid = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = req.model or model_id
    obj = "chat.completion" if is_chat else "text_completion"
    if not req.stream:
        out = await gen.outcome()
        fin, reply = out.fin, out.reply
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.calls:
                message["tool_calls"] = tool_calls(reply)
            else:
                message["content"] = reply.content
            choice["message"] = message
        else:
            choice["text"] = fin.text
        choice["finish_reason"] = finish_reason(fin, reply)
        body = {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice], "usage": usage(fin)}  # fmt: skip
        return JSONResponse(body, headers=gen.headers)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    wire = ChunkWire(rid, created, model, obj, is_chat, include_usage)
    lines = await gen.stream(wire)  # early errors are still a 4xx, not a broken stream
    return StreamingResponse(lines, media_type="text/event-stream", headers=gen.headers)


@dataclass(slots=True)
class ChunkWire:
    """Chat completion chunks (``delta``) or text completion chunks (``text``) as SSE."""

    stream_id: str
    created: int
    model: str
    obj: str
    is_chat: bool
    include_usage: bool
    keep_alive: str = ": prefill\n\n"  # an SSE comment: clients skip it

    def chunk(self, delta: dict[str, Any], text: str | None, reason: str | None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.is_chat:
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {"id": self.stream_id, "object": self.obj + (".chunk" if self.is_chat else ""),
               "created": self.created, "model": self.model, "choices": [choice]}  # fmt: skip
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def begin(self) -> list[str]:
        return []

    def started(self, prefill: PrefillDone | None) -> list[str]:
        # the first chunk marks the end of the prefill, as clients measuring TTFT expect
        return [self.chunk({"role": "assistant", "content": ""}, "", None)]

    def delta(self, reasoning: str, text: str) -> list[str]:
        out = [self.chunk({"reasoning_content": reasoning}, None, None)] if reasoning else []
        if text:
            out.append(self.chunk({"content": text}, text, None))
        return out

    def done(self, fin: Finished, reply: Reply) -> list[str]:
        out = []
        for i, (cid, call) in enumerate(reply.calls):
            head = {"index": i, "id": cid, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}  # fmt: skip
            out.append(self.chunk({"tool_calls": [head]}, None, None))
            args = {"index": i, "function": {"arguments": call.arguments}}
            out.append(self.chunk({"tool_calls": [args]}, None, None))
        out.append(self.chunk({}, "", finish_reason(fin, reply)))
        if self.include_usage:
            out.append(sse({"id": self.stream_id, "object": self.obj + (".chunk" if self.is_chat
                            else ""), "created": self.created, "model": self.model,
                            "choices": [], "usage": usage(fin)}))  # fmt: skip
        return out

    def failed(self, message: str, kind: str) -> list[str]:
        return [sse({"error": {"message": message, "type": kind, "param": None, "code": None}})]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


ROUTES = (
    ApiRoute("/v1/chat/completions", chat_completions, ChatCompletionRequest, streams=SSE),
    ApiRoute("/v1/completions", completions, CompletionRequest, streams=SSE),
)
