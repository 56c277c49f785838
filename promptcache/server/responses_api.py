"""The OpenAI Responses API: ``POST /v1/responses`` (plain and streamed with typed events),
``GET`` and ``DELETE /v1/responses/{id}``; ``previous_response_id`` continues a stored one.

A stored response keeps the conversation through it (``response_store``), so a client sending
only the new items renders the same prompt prefix as the turn before: the cache holds it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from promptcache.engines.base import Finished, PrefillDone, RequestError, SamplingParams
from promptcache.server import pipeline
from promptcache.server.pipeline import Reply
from promptcache.server.responses_items import (
    message_item,
    new_id,
    output_items,
    output_text,
    reasoning_item,
    reply_message,
    to_chat,
)
from promptcache.server.responses_tools import ToolSet, call_item, read_tools
from promptcache.server.routes import SSE, ApiRoute
from promptcache.server.schemas.responses import ResponsesRequest
from promptcache.server.sessions import session_of
from promptcache.server.state import ServerState

REASONING_PART = {"type": "reasoning_text", "text": ""}


def usage(fin: Finished, cache_on: bool) -> dict[str, Any]:
    written = fin.prompt_tokens - fin.cached_tokens if cache_on else 0
    return {
        "input_tokens": fin.prompt_tokens,
        "input_tokens_details": {"cached_tokens": fin.cached_tokens, "cache_write_tokens": written},
        "output_tokens": fin.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def skeleton(req: ResponsesRequest, rid: str, model: str, params: SamplingParams) -> dict[str, Any]:
    """The response object before any output (``response.created``), echoing the request."""
    reasoning = req.reasoning or {}
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": model, "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "tools": list(req.tools or []),
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": params.temperature, "top_p": params.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "store": req.store is not False, "metadata": dict(req.metadata or {}), "usage": None,
        "user": req.user, "prompt_cache_key": req.prompt_cache_key,
    }  # fmt: skip


def finished_body(base: dict[str, Any], fin: Finished, output: list[Any], cache_on: bool) -> dict:
    body = {**base, "output": output, "usage": usage(fin, cache_on)}
    if fin.reason in ("length", "context", "timeout", "cancelled"):
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"
        body["completed_at"] = int(time.time())
    return body


async def create(state: ServerState, request: Request, req: ResponsesRequest) -> Any:
    tenant = state.tenant_of(request)
    history: list[dict[str, Any]] = []
    if req.previous_response_id:
        prev = state.responses.get(tenant, req.previous_response_id)
        if prev is None:
            raise RequestError(
                f"previous_response_id: no stored response {req.previous_response_id!r} (it "
                "was not stored, expired, was deleted, or belongs to another tenant)"
            )
        history = prev.messages
    tools = read_tools(req.tools)
    chat, added = to_chat(req, history, tools, state.image_policy)
    temperature = 1.0 if req.temperature is None else req.temperature
    params = SamplingParams(
        state.output_budget(req.max_output_tokens),
        temperature,
        1.0 if req.top_p is None else req.top_p,
        req.top_k,
        req.seed,
    )
    params.session = session_of(request, req.prompt_cache_key, req.user)
    explicit = req.max_output_tokens is not None
    gen = await pipeline.open_chat(state, request, chat, params, explicit)
    rid = new_id("resp_")
    base = skeleton(req, rid, req.model or state.model_id, gen.prep.params)
    conversation = [*history, *added]

    def finish(fin: Finished, reply: Reply, output: list[Any]) -> dict[str, Any]:
        """The response's final body, stored with the conversation through it."""
        body = finished_body(base, fin, output, state.is_cache_on)
        if req.store is not False and fin.reason != "cancelled":
            state.responses.put(tenant, body, [*conversation, reply_message(reply)], params.session)
        return body

    if not req.stream:
        out = await gen.outcome()
        status = "completed" if out.fin.reason == "stop" else "incomplete"
        body = finish(out.fin, out.reply, output_items(out.reply, tools, status))
        return JSONResponse(body, headers=gen.headers)
    lines = await gen.stream(ResponseWire(tools, base, finish))  # early errors: still a 4xx
    return StreamingResponse(lines, media_type="text/event-stream", headers=gen.headers)


class ResponseWire:
    """The typed server-sent events of one streamed response: a reasoning item (when the
    model's reasoning parser finds any), the message, then the calls."""

    keep_alive = ": prefill\n\n"  # an SSE comment: clients skip it

    def __init__(
        self,
        tools: ToolSet,
        base: dict[str, Any],
        finish: Callable[[Finished, Reply, list[Any]], dict[str, Any]],
    ) -> None:
        self.base, self.tools, self.finish = base, tools, finish
        self.stream_id = str(base["id"])
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items done so far
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.text = ""  # the open item's text so far
        self.kinds_done: set[str] = set()

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def begin(self) -> list[str]:
        return [self.event("response.created", response=self.base)]

    def started(self, prefill: PrefillDone | None) -> list[str]:
        return (
            [self.event("response.in_progress", response=self.base)] if prefill is not None else []
        )

    def delta(self, reasoning: str, text: str) -> list[str]:
        return self._piece("reasoning", reasoning) + self._piece("message", text)

    def done(self, fin: Finished, reply: Reply) -> list[str]:
        """The items still to stream after the last token, then the final response."""
        out: list[str] = []
        is_message_open = self.open is not None and self.open["type"] == "message"
        if not reply.calls and "message" not in self.kinds_done and not is_message_open:
            out += self._empty_message()
        if self.open is not None:
            out += self._close("completed" if fin.reason == "stop" else "incomplete")
        for cid, call in reply.calls:
            out += self._call(cid, call.name, call.arguments)
        body = self.finish(fin, reply, self.items)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        out.append(self.event(kind, response=body))
        return out

    def failed(self, message: str, kind: str) -> list[str]:
        """An error event and a failed response."""
        code = "rate_limit_exceeded" if kind == "overloaded_error" else "server_error"
        failed = {**self.base, "status": "failed", "output": self.items,
                  "error": {"code": code, "message": message}}  # fmt: skip
        return [
            self.event("error", code=kind, message=message, param=None),
            self.event("response.failed", response=failed),
        ]

    def end(self) -> list[str]:
        return []

    def _piece(self, kind: str, piece: str) -> list[str]:
        """Events for a piece of reasoning or message text (opening its item when needed)."""
        if not piece:
            return []
        out = []
        if self.open is not None and self.open["type"] != kind:
            out += self._close("completed")
        index = len(self.items)
        if self.open is None:
            item_id = new_id("rs_" if kind == "reasoning" else "msg_")
            if kind == "reasoning":
                item, part = reasoning_item(item_id, "", "in_progress"), REASONING_PART
            else:
                item, part = message_item(item_id, "", "in_progress"), output_text("")
            self.open, self.text = item, ""
            out.append(self.event("response.output_item.added", output_index=index, item=item))
            out.append(self.event("response.content_part.added", item_id=item_id,
                                  output_index=index, content_index=0, part=part))  # fmt: skip
        self.text += piece
        where = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=piece))
        else:
            out.append(self.event("response.output_text.delta", **where, delta=piece, logprobs=[]))
        return out

    def _close(self, status: str) -> list[str]:
        assert self.open is not None
        item_id, index, text = self.open["id"], len(self.items), self.text
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if self.open["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, text=text)]
            part = {"type": "reasoning_text", "text": text}
            item = reasoning_item(item_id, text, status)
        else:
            out = [self.event("response.output_text.done", **where, text=text, logprobs=[])]
            part = output_text(text)
            item = {**message_item(item_id, text), "status": status}
        out.append(self.event("response.content_part.done", **where, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self.kinds_done.add(str(item["type"]))
        self.open = None
        return out

    def _call(self, cid: str, name: str, arguments: str) -> list[str]:
        item_id, index = new_id("fc_"), len(self.items)
        head = call_item(item_id, cid, name, arguments, self.tools, "in_progress")
        out = [self.event("response.output_item.added", output_index=index, item=head)]
        done = call_item(item_id, cid, name, arguments, self.tools)
        where = {"item_id": item_id, "output_index": index}
        if done["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.delta", **where,
                                  delta=arguments))  # fmt: skip
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=arguments))  # fmt: skip
        else:
            out.append(self.event("response.custom_tool_call_input.delta", **where,
                                  delta=done["input"]))  # fmt: skip
            out.append(self.event("response.custom_tool_call_input.done", **where,
                                  input=done["input"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return out

    def _empty_message(self) -> list[str]:
        """An empty reply is still one message item (as the unstreamed response has)."""
        out = []
        if self.open is not None:
            out += self._close("completed")
        item_id, index = new_id("msg_"), len(self.items)
        self.open, self.text = message_item(item_id, "", "in_progress"), ""
        out.append(self.event("response.output_item.added", output_index=index, item=self.open))
        out.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                              content_index=0, part=output_text("")))  # fmt: skip
        return out


def _stored(state: ServerState, request: Request, response_id: str) -> Any:
    entry = state.responses.get(state.tenant_of(request), response_id)
    if entry is None:
        raise StarletteHTTPException(404, f"no stored response {response_id!r}")
    return entry


async def get(state: ServerState, request: Request, response_id: str) -> Any:
    return _stored(state, request, response_id).body


async def delete(state: ServerState, request: Request, response_id: str) -> Any:
    _stored(state, request, response_id)
    state.responses.delete(state.tenant_of(request), response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def stored_response(state: ServerState, request: Request, response_id: str) -> Any:
    if request.method == "DELETE":
        return await delete(state, request, response_id)
    return await get(state, request, response_id)


ROUTES = (
    ApiRoute("/v1/responses", create, ResponsesRequest, streams=SSE),
    # one route for both methods, so a 405 names both in Allow
    ApiRoute(
        "/v1/responses/{response_id}",
        stored_response,
        methods=("GET", "DELETE"),
        errors={404: {"description": "No such stored response for this tenant"}},
        doc="A stored response (``store`` was not false) of the caller's tenant: GET returns "
        "it, DELETE removes it.",
    ),
)
