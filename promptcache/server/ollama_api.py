"""An Ollama-compatible API for the clients that speak only it (Open WebUI, Continue, IDE
plugins): ``/api/chat`` and ``/api/generate`` (NDJSON streams by default, ``stream: false``
too), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``. The same cache, tools
(Ollama's ``tool_calls`` with object arguments), reasoning (``thinking``) and tenants as the
other APIs; errors are ``{"error": message}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError, TextDelta
from promptcache.server import ollama_items as items
from promptcache.server.chat import Chat
from promptcache.server.schemas import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaShowRequest,
)
from promptcache.server.sessions import session_of
from promptcache.server.state import Prepared, Reply, ServerState
from promptcache.server.streaming import keep_alive, start_first, stream_error
from promptcache.tools import ParsedReply, ReplyStreamer

IGNORED_HEADER = "x-promptcache-ignored-options"
NDJSON = "application/x-ndjson"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(data: dict[str, Any]) -> str:
    return json.dumps(data) + "\n"


class Clock:
    """Ollama's durations (nanoseconds): the whole request, the prompt (to the first token)
    and the generation after it."""

    def __init__(self) -> None:
        self.start_ns = time.perf_counter_ns()
        self.prefill_ns = 0

    def prefilled(self, ev: PrefillDone) -> None:
        self.prefill_ns = int(ev.ttft_s * 1e9)

    def stats(self, fin: Finished) -> dict[str, Any]:
        total = time.perf_counter_ns() - self.start_ns
        return {
            "done_reason": "length" if fin.reason in ("length", "context", "timeout") else "stop",
            "total_duration": total,
            "load_duration": 0,
            # as Ollama counts them: the prompt tokens evaluated (the cached ones are not)
            "prompt_eval_count": fin.prompt_tokens - fin.cached_tokens,
            "prompt_eval_duration": self.prefill_ns,
            "eval_count": fin.completion_tokens,
            "eval_duration": max(0, total - self.prefill_ns),
            "cached_tokens": fin.cached_tokens,  # ours: the prompt tokens the cache gave
        }


def ollama_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": cid, "function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}}
        for i, (cid, c) in enumerate(reply.calls)
    ]


async def chat(state: ServerState, request: Request, req: OllamaChatRequest) -> Any:
    opts = items.read_options(req, state)
    chat_ = items.chat_of(req, state.image_policy)
    opts.params.session = session_of(request)
    prep = await run_in_threadpool(state.prepare, request, chat_, opts.params, opts.explicit_max)
    return await _respond(state, request, req, prep, chat_, opts.ignored, "message")


async def generate(state: ServerState, request: Request, req: OllamaGenerateRequest) -> Any:
    model = req.model or state.model_id
    if not req.prompt and not req.images:  # Ollama's way to load a model: nothing to generate
        return {"model": model, "created_at": now_iso(), "response": "", "done": True,
                "done_reason": "load"}  # fmt: skip
    if req.context:
        raise RequestError(
            "context: continuing from returned token ids is not supported; send the "
            "conversation to /api/chat (the prompt cache makes the resent history cheap)"
        )
    if req.suffix:
        raise RequestError("suffix (fill-in-the-middle) is not supported")
    opts = items.read_options(req, state)
    opts.params.session = session_of(request)
    if req.raw:
        prompt = await run_in_threadpool(state.engine.encode_text, req.prompt)
        tenant = state.tenant_of(request)
        prep = state.prepare_ids(request, prompt, opts.params, tenant, opts.explicit_max)
        return await _respond(state, request, req, prep, None, opts.ignored, "response")
    messages = [{"role": "system", "content": req.system}] if req.system else []
    user = OllamaMessage(role="user", content=req.prompt, images=req.images)
    messages += items.to_messages([user], state.image_policy)
    chat_ = Chat(messages)
    items.apply_format(chat_, req.format)
    items.apply_think(chat_, req.think)
    prep = await run_in_threadpool(state.prepare, request, chat_, opts.params, opts.explicit_max)
    return await _respond(state, request, req, prep, chat_, opts.ignored, "response")


async def _respond(
    state: ServerState,
    request: Request,
    req: Any,
    prep: Prepared,
    chat_: Chat | None,
    ignored: list[str],
    field: str,
) -> Any:
    """``field``: "message" (/api/chat) or "response" (/api/generate)."""
    clock = Clock()
    model = req.model or state.model_id
    headers = dict(prep.headers)
    if ignored:
        headers[IGNORED_HEADER] = ",".join(ignored)
    events = state.events(request, prep.prompt, prep.params, prep.tenant, chat_, prep.images)

    def body(text: str, thinking: str = "", calls: list[Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": now_iso()}
        if field == "message":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        return out

    def reply_of(fin: Finished) -> Reply:
        if chat_ is None:
            return Reply(fin.text, [])
        return state.finish_reply(chat_, prep, fin, "call_")

    if not req.stream:
        fin = None
        async for ev in events:
            if isinstance(ev, PrefillDone):
                clock.prefilled(ev)
            elif isinstance(ev, Finished):
                fin = ev
        assert fin is not None
        reply = reply_of(fin)
        out = body(reply.content, reply.reasoning, ollama_calls(reply))
        return JSONResponse({**out, "done": True, **clock.stats(fin)}, headers=headers)

    first = await start_first(events)  # early errors are still a 4xx, not a broken stream
    streamer = None
    if chat_ is not None:
        parser = state.formatter.parser if chat_.can_call_tools else None
        streamer = ReplyStreamer(state.formatter.reasoning, parser, chat_.reasoning_open)
    stream = _stream(first, events, streamer, clock, body, reply_of)
    return StreamingResponse(stream, media_type=NDJSON, headers=headers)


async def _stream(
    first: Any,
    events: AsyncIterator[Any],
    streamer: ReplyStreamer | None,
    clock: Clock,
    body: Callable[..., dict[str, Any]],
    reply_of: Callable[[Finished], Reply],
) -> AsyncIterator[str]:
    try:
        async for _ in keep_alive(first, ""):  # NDJSON has no comments: just wait
            pass
        ev = first.result()
        if not isinstance(ev, PrefillDone):  # cancelled while queued: nobody is listening
            return
        clock.prefilled(ev)
        async for ev in events:
            if isinstance(ev, TextDelta):
                thought, piece = streamer.push(ev.text) if streamer else ("", ev.text)
                if thought or piece:
                    yield line({**body(piece, thought), "done": False})
            elif isinstance(ev, Finished):
                reply = reply_of(ev)
                if streamer is not None:
                    left = ParsedReply(reply.content, [], reply.reasoning)
                    thought, rest = streamer.left(left)
                    if thought or rest:
                        yield line({**body(rest, thought), "done": False})
                if reply.calls:
                    yield line({**body("", "", ollama_calls(reply)), "done": False})
                yield line({**body(""), "done": True, **clock.stats(ev)})
    except Exception as exc:  # once streaming, an error is a line of its own
        message, _ = stream_error(exc, "ollama")
        yield line({"error": message})


# -- the model ---------------------------------------------------------------------------------


def _entry(state: ServerState) -> dict[str, Any]:
    name = state.model_id
    return {"name": name, "model": name, "modified_at": now_iso(), "size": 0,
            "digest": items.digest(state), "details": items.details(state)}  # fmt: skip


def tags(state: ServerState) -> dict[str, Any]:
    return {"models": [_entry(state)]}


def ps(state: ServerState) -> dict[str, Any]:
    loaded = {**_entry(state), "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
              "context_length": state.engine_limits.max_context}  # fmt: skip
    return {"models": [loaded]}


def show(state: ServerState, req: OllamaShowRequest) -> dict[str, Any]:
    """Any name shows the served model (requests are served whatever ``model`` says)."""
    arch = items.family(state)
    template = getattr(state.engine.tokenizer, "chat_template", None)
    return {
        "modelfile": f"# served by promptcache\nFROM {state.model_id}\n",
        "parameters": "",
        "template": template if isinstance(template, str) else "",
        "details": items.details(state),
        "model_info": {
            "general.architecture": arch,
            "general.basename": state.model_id,
            f"{arch}.context_length": state.engine_limits.max_context,
        },
        "capabilities": items.capabilities(state),
        "modified_at": now_iso(),
    }


def version() -> dict[str, str]:
    return {"version": items.VERSION}
