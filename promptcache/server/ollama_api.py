"""An Ollama-compatible API for the clients that speak only it (Open WebUI, Continue, IDE
plugins): ``/api/chat`` and ``/api/generate`` (NDJSON streams by default, ``stream: false``
too), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``. The same cache, tools
(Ollama's ``tool_calls`` with object arguments), reasoning (``thinking``) and tenants as the
other APIs; errors are ``{"error": message}``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError
from promptcache.server import ollama_items as items
from promptcache.server import pipeline
from promptcache.server.chat import Chat
from promptcache.server.errors import ApiErrors
from promptcache.server.pipeline import Generation, Reply
from promptcache.server.routes import NDJSON, ApiRoute
from promptcache.server.schemas.ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaShowRequest,
)
from promptcache.server.sessions import session_of
from promptcache.server.state import ServerState
from promptcache.server.tool_kinds import names_header

IGNORED_HEADER = "x-promptcache-ignored-options"


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
    gen = await pipeline.open_chat(state, request, chat_, opts.params, opts.explicit_max)
    return await _respond(gen, req.model or state.model_id, req.stream, opts.ignored, "message")


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
        gen = pipeline.open_prompt(state, request, prompt, opts.params, tenant, opts.explicit_max)
        return await _respond(gen, model, req.stream, opts.ignored, "response")
    messages = [{"role": "system", "content": req.system}] if req.system else []
    user = OllamaMessage(role="user", content=req.prompt, images=req.images)
    messages += items.to_messages([user], state.image_policy)
    chat_ = Chat(messages)
    items.apply_format(chat_, req.format)
    items.apply_think(chat_, req.think)
    gen = await pipeline.open_chat(state, request, chat_, opts.params, opts.explicit_max)
    return await _respond(gen, model, req.stream, opts.ignored, "response")


async def _respond(
    gen: Generation, model: str, stream: bool, ignored: list[str], field: str
) -> Any:
    """``field``: "message" (/api/chat) or "response" (/api/generate)."""
    clock = Clock()
    headers = dict(gen.headers)
    headers.update(names_header(IGNORED_HEADER, ignored))
    wire = LineWire(model, field, clock)
    if not stream:
        out = await gen.outcome()
        if out.prefill is not None:
            clock.prefilled(out.prefill)
        reply = out.reply
        body = wire.body(reply.content, reply.reasoning, ollama_calls(reply))
        return JSONResponse({**body, "done": True, **clock.stats(out.fin)}, headers=headers)
    lines = await gen.stream(wire)  # early errors are still a 4xx, not a broken stream
    return StreamingResponse(lines, media_type=NDJSON, headers=headers)


class LineWire:
    """Ollama's stream: one JSON object a line, the last with ``done`` and the durations."""

    stream_id = "ollama"
    keep_alive = ""  # NDJSON has no comments: just wait

    def __init__(self, model: str, field: str, clock: Clock) -> None:
        self.model, self.field, self.clock = model, field, clock

    def body(self, text: str, thinking: str = "", calls: list[Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.field == "message":
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

    def begin(self) -> list[str]:
        return []

    def started(self, prefill: PrefillDone | None) -> list[str]:
        if prefill is not None:
            self.clock.prefilled(prefill)
        return []

    def delta(self, reasoning: str, text: str) -> list[str]:
        return [line({**self.body(text, reasoning), "done": False})]

    def done(self, fin: Finished, reply: Reply) -> list[str]:
        out = []
        if reply.calls:
            out.append(line({**self.body("", "", ollama_calls(reply)), "done": False}))
        out.append(line({**self.body(""), "done": True, **self.clock.stats(fin)}))
        return out

    def failed(self, message: str, kind: str) -> list[str]:
        return [line({"error": message})]

    def end(self) -> list[str]:
        return []


# -- the model ---------------------------------------------------------------------------------


def _entry(state: ServerState) -> dict[str, Any]:
    name = state.model_id
    return {"name": name, "model": name, "modified_at": now_iso(), "size": 0,
            "digest": items.digest(state), "details": items.details(state)}  # fmt: skip


async def tags(state: ServerState, request: Request) -> dict[str, Any]:
    return {"models": [_entry(state)]}


async def ps(state: ServerState, request: Request) -> dict[str, Any]:
    loaded = {**_entry(state), "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
              "context_length": state.engine_limits.max_context}  # fmt: skip
    return {"models": [loaded]}


async def show(state: ServerState, request: Request, req: OllamaShowRequest) -> dict[str, Any]:
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


async def version(state: ServerState, request: Request) -> dict[str, str]:
    return {"version": items.VERSION}


# Ollama's clients read {"error": message}
ERRORS = ApiErrors("/api/", lambda status, message, param, code: {"error": message})

ROUTES = (
    ApiRoute("/api/chat", chat, OllamaChatRequest, streams=NDJSON),
    ApiRoute("/api/generate", generate, OllamaGenerateRequest, streams=NDJSON),
    ApiRoute("/api/tags", tags, methods=("GET",)),
    ApiRoute("/api/show", show, OllamaShowRequest),
    ApiRoute("/api/ps", ps, methods=("GET",)),
    ApiRoute("/api/version", version, methods=("GET",)),
)
