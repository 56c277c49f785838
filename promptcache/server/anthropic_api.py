"""Anthropic-compatible endpoints: /v1/messages and /v1/messages/count_tokens (Claude Code)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError, SamplingParams
from promptcache.errors import PromptTooLongError
from promptcache.server import pipeline
from promptcache.server.chat import Chat
from promptcache.server.errors import ApiErrors, error_kind
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, anthropic_image, image_part
from promptcache.server.pipeline import Reply
from promptcache.server.routes import SSE, ApiRoute
from promptcache.server.schemas.anthropic import CountTokensRequest, MessagesRequest
from promptcache.server.sessions import session_of, ttl_hint
from promptcache.server.state import ServerState
from promptcache.server.tool_kinds import set_aside

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
    gen = await pipeline.open_chat(state, request, chat, params, call_prefix="toolu_")
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = req.model or state.model_id
    prep = gen.prep
    is_clamped = prep.clamped_from is not None
    if not req.stream:
        out = await gen.outcome()
        fin, reply = out.fin, out.reply
        reason, seq = stop_info(fin, reply, prep.is_capped, is_clamped)
        return JSONResponse(
            {"id": mid, "type": "message", "role": "assistant", "model": model,
             "content": content_blocks(reply), "stop_reason": reason, "stop_sequence": seq,
             "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)},
            headers=gen.headers,
        )  # fmt: skip
    wire = MessageWire(mid, model, prep.is_capped, is_clamped)
    lines = await gen.stream(wire)  # early errors are still a 4xx, not a broken stream
    return StreamingResponse(lines, media_type="text/event-stream", headers=gen.headers)


class MessageWire:
    """Anthropic's message events: thinking and text blocks as they stream, then the
    ``tool_use`` blocks, the stop reason and usage."""

    keep_alive = event("ping", {})  # SDKs skip pings

    def __init__(self, mid: str, model: str, is_capped: bool, is_clamped: bool) -> None:
        self.stream_id, self.model = mid, model
        self.is_capped, self.is_clamped = is_capped, is_clamped
        self.index, self.open_kind, self.thought = 0, "", ""
        self.has_text = False  # a text block was streamed

    def begin(self) -> list[str]:
        return []

    def started(self, prefill: PrefillDone | None) -> list[str]:
        if prefill is None:
            return []
        message = {"id": self.stream_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(prefill.prompt_tokens, prefill.cached_tokens, 0)}  # fmt: skip
        return [event("message_start", {"message": message}), event("ping", {})]

    def delta(self, reasoning: str, text: str) -> list[str]:
        return (self._piece("thinking", reasoning) if reasoning else []) + (
            self._piece("text", text) if text else []
        )

    def done(self, fin: Finished, reply: Reply) -> list[str]:
        out = []
        if not self.has_text and not reply.calls:  # an empty reply is still one text block
            out += self._piece("text", "")
        out += self._close()
        for cid, call in reply.calls:
            index = self.index
            block = {"type": "tool_use", "id": cid, "name": call.name, "input": {}}
            out.append(event("content_block_start", {"index": index, "content_block": block}))
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            out.append(event("content_block_delta", {"index": index, "delta": delta}))
            out.append(event("content_block_stop", {"index": index}))
            self.index += 1
        reason, seq = stop_info(fin, reply, self.is_capped, self.is_clamped)
        out.append(event(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": seq},
             "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)},
        ))  # fmt: skip
        out.append(event("message_stop", {}))
        return out

    def failed(self, message: str, kind: str) -> list[str]:
        return [event("error", {"error": {"type": kind, "message": message}})]

    def end(self) -> list[str]:
        return []

    def _close(self) -> list[str]:
        if not self.open_kind:
            return []
        out = []
        if self.open_kind == "thinking":  # the signature closes a thinking block
            delta = {"type": "signature_delta", "signature": signature(self.thought)}
            out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        out.append(event("content_block_stop", {"index": self.index}))
        self.index, self.open_kind, self.thought = self.index + 1, "", ""
        return out

    def _piece(self, kind: str, text: str) -> list[str]:
        """A text or thinking delta, in a block of its kind (opened, the other closed)."""
        out = []
        if self.open_kind != kind:
            out += self._close()
            self.open_kind = kind
            block = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""}  # fmt: skip
            out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        if kind == "thinking":
            self.thought += text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            self.has_text = True
            delta = {"type": "text_delta", "text": text}
        out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_kind(status), "message": message}}


def too_long(exc: PromptTooLongError) -> tuple[str, dict[str, str]]:
    if exc.max_tokens:  # --strict-max-tokens: the prompt fits, the output does not
        return (
            f"input length and `max_tokens` exceed context limit: {exc.num_tokens} + "
            f"{exc.max_tokens} > {exc.max_context}, decrease input length or "
            "`max_tokens` and try again"
        ), {}
    return f"prompt is too long: {exc.num_tokens} tokens > {exc.max_context} maximum", {}


ERRORS = ApiErrors("/v1/messages", error_body, too_long)

ROUTES = (
    ApiRoute("/v1/messages", messages, MessagesRequest, streams=SSE),
    ApiRoute("/v1/messages/count_tokens", count_tokens, CountTokensRequest),
)
