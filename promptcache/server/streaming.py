"""Run an engine generation on a worker thread and consume its events from asyncio.

The engine serves one generation at a time (its lock is the queue); waiting requests park on
worker threads. A client that disconnects sets the cancel event: a queued request is dropped
before prefill, a running one stops at its next token, and its pinned blocks are released.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request

from promptcache.engines.base import Event, Finished

_DONE = object()
_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="promptcache-gen")
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
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    cancel.set()
                continue
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            finished = isinstance(item, Finished)
            yield item
    finally:
        # a generation the client abandoned stops at its next token; a finished one goes on
        # in the background to save prompt + reply to the cache (the engine lock orders it)
        if not finished:
            cancel.set()
