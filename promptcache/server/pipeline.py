"""One chat pipeline behind every API: render -> check -> generate -> parse, one streaming loop.

An API module only translates: its request body into a ``Chat`` (or raw prompt ids) and
``SamplingParams``, opened here (``open_chat`` / ``open_prompt``: rendered and checked by
``prepare``); then what comes back into its wire format. Not streamed, ``Generation.outcome``
is the finished generation with its parsed ``Reply``. Streamed, ``Generation.stream`` runs the
one loop: the engine's tokens on a worker thread (``streaming.run_events``), split into
reasoning and text as they come (``ReplyStreamer``), parsed at the end (tool calls, the
reasoning, remembered for the next turn's continuity), as neutral events that the API's ``Wire``
turns into its lines (SSE events, NDJSON):

- ``Wire.begin``: before anything (the Responses API's ``response.created``);
- ``Wire.keep_alive``: repeated while a long prefill runs (``""``: none);
- ``Wire.started(prefill)``: the prompt is in (usage so far); None: cancelled while queued,
  and the stream ends there;
- ``Wire.delta(reasoning, text)``: new reasoning and visible text, either possibly empty;
- ``Wire.done(fin, reply)``: the finished generation (finish reason, usage) and the parsed
  reply: its content, reasoning and tool calls (with ids); the text not streamed yet came in
  a last delta;
- ``Wire.failed(message, kind)``: an error once streaming (never a broken connection);
- ``Wire.end``: after everything, errors too (OpenAI's ``[DONE]``).

Errors before the first event (within ``streaming.GRACE_S``) still raise from ``stream``, so
they answer with a 4xx/5xx status instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from promptcache.engines.base import Event, Finished, PrefillDone, SamplingParams, TextDelta
from promptcache.server.chat import Chat, new_call_id
from promptcache.server.prepare import Prepared, prepare, prepare_ids
from promptcache.server.state import QueueFullError, ServerState
from promptcache.server.streaming import keep_alive, run_events, start_first, stream_error
from promptcache.tools import ParsedReply, ReplyStreamer, ToolCall


class Reply(NamedTuple):
    content: str
    calls: list[tuple[str, ToolCall]]  # (call id, call)
    reasoning: str = ""  # never part of content


@dataclass(frozen=True, slots=True)
class Delta:
    """New reasoning and visible text of a streamed reply (either may be empty)."""

    reasoning: str
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    """The finished generation (finish reason, usage) and its parsed reply."""

    fin: Finished
    reply: Reply


@dataclass(frozen=True, slots=True)
class Outcome:
    """A generation run to its end (not streamed)."""

    fin: Finished
    reply: Reply
    prefill: PrefillDone | None  # None: cancelled before its prefill


class Wire(Protocol):
    """An API's stream format: the lines each neutral event becomes (see the module doc)."""

    stream_id: str  # names the stream in the log
    keep_alive: str

    def begin(self) -> list[str]: ...
    def started(self, prefill: PrefillDone | None) -> list[str]: ...
    def delta(self, reasoning: str, text: str) -> list[str]: ...
    def done(self, fin: Finished, reply: Reply) -> list[str]: ...
    def failed(self, message: str, kind: str) -> list[str]: ...
    def end(self) -> list[str]: ...


async def open_chat(
    state: ServerState,
    request: Request,
    chat: Chat,
    params: SamplingParams,
    explicit_max: bool = True,
    call_prefix: str = "call_",
) -> Generation:
    """A chat request rendered and checked (on a thread: the template and tokenizer block);
    its tool calls get ids starting with ``call_prefix``."""
    prep = await run_in_threadpool(prepare, state, request, chat, params, explicit_max)
    return Generation(state, request, prep, chat, call_prefix)


def open_prompt(
    state: ServerState,
    request: Request,
    prompt: list[int],
    params: SamplingParams,
    tenant: str,
    explicit_max: bool = True,
) -> Generation:
    """A raw prompt's ids checked (completions, Ollama's raw generate): no template, no parse."""
    return Generation(state, request, prepare_ids(state, request, prompt, params, tenant,
                                                  explicit_max), None)  # fmt: skip


class Generation:
    """One request from its checked prompt to its parsed reply."""

    def __init__(
        self,
        state: ServerState,
        request: Request,
        prep: Prepared,
        chat: Chat | None,
        call_prefix: str = "call_",
    ) -> None:
        self.state, self.request, self.prep, self.chat = state, request, prep, chat
        self.call_prefix = call_prefix  # of tool call ids (Anthropic's are "toolu_")

    @property
    def headers(self) -> dict[str, str]:
        return self.prep.headers

    def reply(self, fin: Finished) -> Reply:
        """The finished text parsed: tool calls (with fresh ids), reasoning, content;
        remembered so that the next turn renders this reply to the same tokens."""
        chat, prep, formatter = self.chat, self.prep, self.state.formatter
        if chat is None:
            return Reply(fin.text, [])
        parsed = formatter.parse(chat, fin.text)
        if fin.reason != "cancelled":
            ids = prep.prompt + list(fin.completion_ids)
            formatter.remember(prep.tenant, parsed, fin.text, ids, prep.params.session)
        calls = [(c.id or new_call_id(self.call_prefix), c) for c in parsed.calls]
        return Reply(parsed.content, calls, parsed.reasoning)

    async def outcome(self) -> Outcome:
        """Run to the end: the Finished event and the reply (the other events are dropped)."""
        fin, prefill = None, None
        async for ev in self._engine_events():
            if isinstance(ev, PrefillDone):
                prefill = ev
            elif isinstance(ev, Finished):
                fin = ev
        assert fin is not None  # every generation ends with Finished or raises
        return Outcome(fin, self.reply(fin), prefill)

    async def stream(self, wire: Wire) -> AsyncIterator[str]:
        """The stream's lines; awaits the first event a short while first, so that an early
        error (a full queue, a bad grammar) still raises here, before any response."""
        events = self._engine_events()
        first = await start_first(events)
        return self._lines(wire, first, events)

    async def _lines(
        self, wire: Wire, first: Any, events: AsyncIterator[Event]
    ) -> AsyncIterator[str]:
        try:
            for line in wire.begin():
                yield line
            async for line in keep_alive(first, wire.keep_alive):
                if line:
                    yield line
            prefill = first.result()
            prefill = prefill if isinstance(prefill, PrefillDone) else None
            for line in wire.started(prefill):
                yield line
            if prefill is None:  # cancelled while queued: nobody is listening
                return
            async for out in self._neutral(events):
                if isinstance(out, Delta):
                    lines = wire.delta(out.reasoning, out.text)
                else:
                    lines = wire.done(out.fin, out.reply)
                for line in lines:
                    yield line
        except Exception as exc:  # once streaming, an error is the wire's own error lines
            for line in wire.failed(*stream_error(exc, wire.stream_id)):
                yield line
        for line in wire.end():
            yield line

    async def _neutral(self, events: AsyncIterator[Event]) -> AsyncIterator[Delta | Done]:
        """The neutral events: deltas as tokens come, then the parsed reply at the end."""
        chat, formatter = self.chat, self.state.formatter
        streamer = None
        if chat is not None:
            parser = formatter.parser if chat.can_call_tools else None
            streamer = ReplyStreamer(formatter.reasoning, parser, chat.reasoning_open)
        async for ev in events:
            if isinstance(ev, TextDelta):
                reasoning, text = streamer.push(ev.text) if streamer else ("", ev.text)
                if reasoning or text:
                    yield Delta(reasoning, text)
            elif isinstance(ev, Finished):
                reply = self.reply(ev)
                if streamer is not None:  # what the parse found that was not streamed yet
                    reasoning, text = streamer.left(ParsedReply(reply.content, [], reply.reasoning))
                    if reasoning or text:
                        yield Delta(reasoning, text)
                yield Done(ev, reply)

    async def _engine_events(self) -> AsyncIterator[Event]:
        """The engine's events, counted against --max-queue while the request runs."""
        state = self.state
        if state.num_active >= state.limits.max_queue:
            raise QueueFullError(state.limits.max_queue)
        state.num_active += 1
        try:
            async for ev in run_events(self.request, self._generate):
                yield ev
        finally:
            state.num_active -= 1

    def _generate(self, cancel: threading.Event) -> Iterator[Event]:
        """On the worker thread: the generation, then its metrics and cache record (counted
        here, so that a request whose client left is counted too)."""
        state, prep, chat = self.state, self.prep, self.chat
        endpoint = self.request.url.path
        # only a vision engine takes images= (a text-only one never gets any: 400 at the edge)
        extra: dict[str, Any] = {"images": prep.images} if prep.images else {}
        started = time.time()
        prefill: PrefillDone | None = None
        params = prep.params
        for ev in state.engine.generate(prep.prompt, params, prep.tenant, cancel, **extra):
            if isinstance(ev, PrefillDone):
                prefill = ev
            elif isinstance(ev, Finished) and ev.prompt_tokens:
                ttft = prefill.ttft_s if prefill else None
                state.metrics.record(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ttft)
                state.record(endpoint, prep.tenant, prep.prompt, chat, prefill, ev, started,
                             prep.images, params.session)  # fmt: skip
            yield ev
