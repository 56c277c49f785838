"""Run an engine generation on a worker thread and consume its events from asyncio.

The engine's scheduler advances every active request in each step (continuous batching);
each generation's consumer waits (and drives steps) on a worker thread. A client that disconnects sets the cancel event: a queued request is dropped
before prefill, a running one stops at its next token, and its pinned blocks are released.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request

from promptcache.core.worker_threads import worker_initializer
from promptcache.engines.base import EngineTimeoutError, Event, Finished, RequestError

log = logging.getLogger("promptcache.server")

_DONE = object()
# how often a stream waiting for its next event asks whether the client left: every poll is
# main-thread Python that the stepping thread waits on for the GIL (32 streams at 0.25 s
# kept the event loop ~9% of a core busy under load)
DISCONNECT_POLL_S = 1.0
_executor = ThreadPoolExecutor(
    max_workers=64, thread_name_prefix="promptcache-gen", initializer=worker_initializer
)
_active: set[threading.Event] = set()  # cancel events of generations in flight


def cancel_all() -> None:
    """Stop every generation at its next step (server shutdown)."""
    for cancel in list(_active):
        cancel.set()


async def run_events(
    request: Request | None, make_events: Callable[[threading.Event], Iterator[Event]]
) -> AsyncIterator[Event]:
    """Yield the engine's events as they come; raises what the engine raised."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    cancel = threading.Event()
    _active.add(cancel)

    def work() -> None:
        try:
            for event in make_events(cancel):
                loop.call_soon_threadsafe(queue.put_nowait, event)
        except BaseException as exc:  # delivered to the awaiting request
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            _active.discard(cancel)
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    loop.run_in_executor(_executor, work)
    finished = False
    getting: asyncio.Future[Any] | None = None
    try:
        while True:
            # one pending get across timeouts (wait_for would wrap and cancel a task per poll)
            if getting is None:
                getting = asyncio.ensure_future(queue.get())
            await asyncio.wait({getting}, timeout=DISCONNECT_POLL_S)
            if not getting.done():
                if request is not None and await request.is_disconnected():
                    cancel.set()
                continue
            item, getting = getting.result(), None
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            finished = isinstance(item, Finished)
            yield item
    finally:
        if getting is not None:
            getting.cancel()
        # a generation the client abandoned stops at its next token; a finished one goes on
        # in the background to save prompt + reply to the cache (the engine lock orders it)
        if not finished:
            cancel.set()


GRACE_S = 2.0  # errors within this time still get a 4xx/5xx status instead of an error event
KEEPALIVE_S = 10.0  # while a long prefill runs, streams send a keep-alive this often


async def start_first(events: AsyncIterator[Event]) -> asyncio.Future[Event]:
    """Begin waiting for a stream's first event. What fails within GRACE_S raises here, before
    any response is sent; a slower first event (a long prefill) is awaited by ``keep_alive``."""
    first: asyncio.Future[Event] = asyncio.ensure_future(anext(events))
    await asyncio.wait({first}, timeout=GRACE_S)
    if first.done():
        first.result()
    return first


async def keep_alive(first: asyncio.Future[Event], line: str) -> AsyncIterator[str]:
    """Yield ``line`` every KEEPALIVE_S until the first event is there, so clients with an idle
    timeout (Claude Code gives up on a stream after 300 s) keep waiting; the caller then takes
    ``first.result()``. A client that leaves meanwhile cancels the generation."""
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=KEEPALIVE_S)
            if not first.done():
                yield line
    finally:
        if not first.done():
            first.cancel()


def stream_error(exc: Exception, stream_id: str) -> tuple[str, str]:
    """(message, error type) for an error event in a started stream; logged here."""
    if isinstance(exc, EngineTimeoutError):
        log.warning("stream %s: %s", stream_id, exc)
        return str(exc), "overloaded_error"
    if isinstance(exc, RequestError):  # the client's: bad input, too long, a bad grammar
        log.warning("stream %s: %s", stream_id, exc)
        return str(exc), "invalid_request_error"
    log.exception("stream %s failed", stream_id)
    return f"generation failed ({type(exc).__name__}); see the server log", "api_error"
