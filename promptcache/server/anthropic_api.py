"""Anthropic-compatible endpoints: /v1/messages and /v1/messages/count_tokens (Claude Code)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError, SamplingParams, TextDelta
from promptcache.server.chat import Chat
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, anthropic_image, image_part
from promptcache.server.schemas import CountTokensRequest, MessagesRequest
from promptcache.server.sessions import session_of, ttl_hint
from promptcache.server.state import Reply, ServerState
from promptcache.server.streaming import (
    await_finished,
    error_as_line,
    keep_alive,
    start_first,
)
from promptcache.server.tool_kinds import set_aside
from promptcache.tools import ParsedReply, ReplyStreamer

log = logging.getLogger("promptcache.server")

# Claude Code's first system block: per-prompt billing metadata, not an instruction; it changes
# with the first user message and would break the prefix every new session shares
BILLING_PREFIX = "x-anthropic-billing-header:"
# reasoning sent back: thinking blocks reach the template as the turn's reasoning_content (as
# this server returned them); redacted ones (another model's, encrypted) are dropped
DROPPED_BLOCKS = ("thinking", "redacted_thinking")
UNSUPPORTED_MEDIA = ("image", "document")


def _unsupported(kind: str) -> RequestError:
    if kind in UNSUPPORTED_MEDIA:
        return RequestError(
            f"content blocks of type {kind!r} are not supported here (text, tool_use, "
            "tool_result and thinking blocks are; image blocks in user messages on vision models)"
        )
    return RequestError(
        f"content block of type {kind!r} is not supported "
        "(text, tool_use, tool_result, thinking, redacted_thinking)"
    )


def _text_of(blocks: str | list[dict[str, Any]] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            parts.append(str(b.get("text") or ""))
        elif kind not in DROPPED_BLOCKS:
            raise _unsupported(str(kind))
    return "\n".join(parts)


def system_text(req: MessagesRequest | CountTokensRequest, keep_billing: bool) -> str:
    if req.system is None or isinstance(req.system, str):
        return req.system or ""
    texts = [b.text or "" for b in req.system]
    if not keep_billing:
        texts = [t for t in texts if not t.startswith(BILLING_PREFIX)]
    return "\n\n".join(t for t in texts if t)


def to_chat(
    req: MessagesRequest | CountTokensRequest,
    keep_billing: bool = False,
    images: ImagePolicy = TEXT_ONLY,
) -> Chat:
    messages: list[dict[str, Any]] = []
    system = system_text(req, keep_billing)
    if system:
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        parts: list[dict[str, Any]] = []  # text and images in order, when there are images
        calls: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for b in m.content:
            kind = b.get("type")
            if kind == "thinking" and m.role == "assistant":
                thoughts.append(str(b.get("thinking") or ""))
            if kind == "text":
                texts.append(str(b.get("text") or ""))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and m.role == "user":
                parts.append(image_part(anthropic_image(b, images)))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(
                    {"id": b.get("id"), "type": "function",
                     "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}}
                )  # fmt: skip
            elif kind == "tool_result" and m.role == "user":
                content = _text_of(b.get("content"))
                if b.get("is_error"):
                    content = "Error: " + content
                messages.append(
                    {"role": "tool", "content": content, "tool_call_id": b.get("tool_use_id")}
                )
            elif kind not in DROPPED_BLOCKS:
                raise _unsupported(str(kind))
        msg: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
        if len(parts) > len(texts):  # images: the parts in order, text blocks a line apart
            msg["content"] = _joined_parts(parts)
        if calls:
            msg["tool_calls"] = calls
        if any(thoughts):
            msg["reasoning_content"] = "\n".join(t for t in thoughts if t)
        if (
            texts
            or calls
            or len(parts) > len(texts)
            or not any(b.get("type") == "tool_result" for b in m.content)
        ):
            messages.append(msg)
    chat = Chat(messages)
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):  # a server tool: Anthropic's to run, not ours
            set_aside("messages", t.type, chat.ignored_tools)
            continue
        if not t.name:
            raise RequestError(f"tools[{i}]: a tool needs a name")
        chat.tools.append(
            {"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema or {"type": "object"}}}
        )  # fmt: skip
    choice = req.tool_choice or {}
    kind = choice.get("type", "auto")
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError(f"tool_choice.type must be auto, any, tool or none, not {kind!r}")
    chat.tool_choice = {"any": "required", "tool": "named"}.get(kind, kind)
    chat.tool_name = choice.get("name") if kind == "tool" else None
    chat.parallel_tool_calls = not choice.get("disable_parallel_tool_use", False)
    thinking = getattr(req, "thinking", None) or {}
    if thinking.get("type") == "disabled":
        chat.template_kwargs["enable_thinking"] = False
    elif thinking.get("type") in ("enabled", "adaptive"):
        chat.template_kwargs["enable_thinking"] = True
    fmt = (req.output_config or {}).get("format") or req.output_format
    if fmt:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise RequestError(
                "output format: only {type: json_schema, schema: {...}} is supported"
            )
        chat.response_schema = fmt["schema"]
    return chat


def _joined_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text blocks a newline apart (as text-only messages join them), images where they are."""
    out: list[dict[str, Any]] = []
    seen_text = False
    for p in parts:
        if p["type"] == "text":
            out.append({"type": "text", "text": ("\n" if seen_text else "") + p["text"]})
            seen_text = True
        else:
            out.append(p)
    return out


def stop_info(
    fin: Finished, reply: Reply, is_capped: bool = False, is_clamped: bool = False
) -> tuple[str, str | None]:
    if reply.calls and fin.reason != "cancelled":
        return "tool_use", None
    if fin.reason == "timeout":  # the server's time budget, like its token cap: turn over
        return "end_turn", None
    if fin.reason == "length" and is_clamped:  # max_tokens was lowered to the room left
        return "model_context_window_exceeded", None
    if fin.reason == "length":
        # a reply cut by the server's own cap is its whole turn: clients read max_tokens as
        # their limit and fail or retry (Claude Code stops with "exceeded ... maximum")
        return ("end_turn" if is_capped else "max_tokens"), None
    if fin.reason == "context":
        return "model_context_window_exceeded", None
    if fin.stop_sequence is not None:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def signature(thinking: str) -> str:
    """The thinking block's signature: a digest of its text (clients send it back unchanged;
    the text itself is what the next turn renders)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append(
            {
                "type": "thinking",
                "thinking": reply.reasoning,
                "signature": signature(reply.reasoning),
            }
        )
    if reply.content or not reply.calls:
        blocks.append({"type": "text", "text": reply.content})
    for cid, call in reply.calls:
        blocks.append(
            {"type": "tool_use", "id": cid, "name": call.name, "input": json.loads(call.arguments)}
        )
    return blocks


async def count_tokens(state: ServerState, request: Request, req: CountTokensRequest) -> Any:
    chat = to_chat(req, state.keep_billing_header, state.image_policy)
    prompt = await run_in_threadpool(state.formatter.render, chat, state.tenant_of(request))
    return {"input_tokens": len(prompt)}


async def messages(state: ServerState, request: Request, req: MessagesRequest) -> Any:
    chat = to_chat(req, state.keep_billing_header, state.image_policy)
    params = SamplingParams(
        req.max_tokens, req.temperature, req.top_p, req.top_k, None, list(req.stop_sequences or [])
    )
    params.session = session_of(request, (req.metadata or {}).get("user_id"))
    params.cache_ttl_s = ttl_hint(req)
    prep = await run_in_threadpool(state.prepare, request, chat, params)
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = req.model or state.model_id
    events = state.events(request, prep.prompt, prep.params, prep.tenant, chat, prep.images)
    if not req.stream:
        fin = await await_finished(events)
        reply = state.finish_reply(chat, prep, fin, "toolu_")
        reason, seq = stop_info(fin, reply, prep.is_capped, prep.clamped_from is not None)
        return JSONResponse(
            {"id": mid, "type": "message", "role": "assistant", "model": model,
             "content": content_blocks(reply), "stop_reason": reason, "stop_sequence": seq,
             "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)},
            headers=prep.headers,
        )  # fmt: skip

    opening = await start_first(events)  # early errors are still a 4xx, not a broken stream
    parser = state.formatter.parser if chat.can_call_tools else None
    streamer = ReplyStreamer(state.formatter.reasoning, parser, chat.reasoning_open)

    def error(message: str, kind: str) -> str:
        return event("error", {"error": {"type": kind, "message": message}})

    async def body() -> AsyncIterator[str]:
        async for line in keep_alive(opening, event("ping", {})):  # SDKs skip pings
            yield line
        first = opening.result()
        if not isinstance(first, PrefillDone):  # cancelled while queued: nobody is listening
            return
        message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": usage(first.prompt_tokens, first.cached_tokens, 0)}  # fmt: skip
        yield event("message_start", {"message": message})
        yield event("ping", {})
        index, open_kind, thought = 0, "", ""

        def close() -> list[str]:
            nonlocal index, open_kind, thought
            if not open_kind:
                return []
            out = []
            if open_kind == "thinking":  # the signature closes a thinking block
                delta = {"type": "signature_delta", "signature": signature(thought)}
                out.append(event("content_block_delta", {"index": index, "delta": delta}))
            out.append(event("content_block_stop", {"index": index}))
            index, open_kind, thought = index + 1, "", ""
            return out

        def piece(kind: str, text: str) -> list[str]:
            """A text or thinking delta, in a block of its kind (opened, the other closed)."""
            nonlocal open_kind, thought
            out = []
            if open_kind != kind:
                out += close()
                open_kind = kind
                block = {"type": "text", "text": ""} if kind == "text" else {
                    "type": "thinking", "thinking": "", "signature": ""}  # fmt: skip
                out.append(event("content_block_start", {"index": index, "content_block": block}))
            if kind == "thinking":
                thought += text
                delta = {"type": "thinking_delta", "thinking": text}
            else:
                delta = {"type": "text_delta", "text": text}
            out.append(event("content_block_delta", {"index": index, "delta": delta}))
            return out

        async for ev in events:
            if isinstance(ev, TextDelta):
                reasoning, text = streamer.push(ev.text)
                for line in (piece("thinking", reasoning) if reasoning else []) + (
                    piece("text", text) if text else []
                ):
                    yield line
            elif isinstance(ev, Finished):
                reply = state.finish_reply(chat, prep, ev, "toolu_")
                reasoning, rest = streamer.left(ParsedReply(reply.content, [], reply.reasoning))
                lines = piece("thinking", reasoning) if reasoning else []
                if rest or (not streamer.shown and not reply.calls):
                    lines += piece("text", rest)
                for line in lines + close():
                    yield line
                for cid, call in reply.calls:
                    block = {"type": "tool_use", "id": cid, "name": call.name, "input": {}}
                    yield event("content_block_start", {"index": index, "content_block": block})
                    delta = {"type": "input_json_delta", "partial_json": call.arguments}
                    yield event("content_block_delta", {"index": index, "delta": delta})
                    yield event("content_block_stop", {"index": index})
                    index += 1
                reason, seq = stop_info(ev, reply, prep.is_capped, prep.clamped_from is not None)
                yield event(
                    "message_delta",
                    {"delta": {"stop_reason": reason, "stop_sequence": seq},
                     "usage": usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)},
                )  # fmt: skip
                yield event("message_stop", {})

    return StreamingResponse(
        error_as_line(body(), mid, error), media_type="text/event-stream", headers=prep.headers
    )
