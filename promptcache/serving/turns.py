"""Fair turns on one engine: requests take the model one step at a time, in arrival order.

A step is one prefill chunk or one decoded token. A request that finishes a step and wants
another goes to the back of the line, so a long prefill cannot hold everyone else for its whole
length: with N requests active each gets about 1/N of the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimeout(Exception):
    """The request's deadline passed while it waited for its turn."""


class FairTurns:
    """A FIFO ticket lock. ``num_waiting`` counts threads in line (not the holder)."""

    __slots__ = ("_cond", "_next", "_serving", "_abandoned", "num_waiting")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the ticket the next arrival gets
        self._serving = 0  # the ticket whose step runs now (or may start)
        self._abandoned: set[int] = set()  # tickets whose holders timed out: skipped
        self.num_waiting = 0

    @contextmanager
    def step(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the engine for one step. Raises StepTimeout if the turn does not come within
        ``timeout`` seconds; the ticket is then skipped, so nobody behind it waits for it."""
        with self._cond:
            ticket = self._next
            self._next += 1
            self.num_waiting += 1
            try:
                ok = self._cond.wait_for(lambda: self._serving == ticket, timeout)
            finally:
                self.num_waiting -= 1
            if not ok:
                self._abandoned.add(ticket)
                self._advance(0)
                raise StepTimeout
        try:
            yield
        finally:
            with self._cond:
                self._advance(1)

    def _advance(self, by: int) -> None:
        self._serving += by
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()
