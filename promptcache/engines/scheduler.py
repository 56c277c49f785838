"""The scheduler: which requests the engine advances, one ``step()`` at a time.

Policy today: FIFO fairness, one request per step. A request is *ready* when its consumer waits
for events (a request whose consumer is busy elsewhere is not advanced: backpressure, as a
generator's would be); ``step()`` advances the longest-waiting ready request by one prefill chunk,
one token or its final save, and a request that wants more goes to the back of the line. With N
requests active each gets about 1/N of the engine, and a long prefill cannot hold everyone else.
A batching policy changes ``step()`` only: take several ready requests, one forward for all.

Nobody runs a loop of steps: the consumers drive. A consumer with no events to read queues its
request, takes a turn on the engine (``FairTurns``: FIFO, with the request's deadline) and runs
``step()``; whichever request that step advances, its consumer finds the events in its outbox.
A consumer that times out, is cancelled or walks away settles its own request without a turn,
once no step is working on it (``in_flight``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from promptcache.engines.base import Event
from promptcache.engines.request import Phase, Request
from promptcache.engines.turns import FairTurns, StepTimeout


class Work(Protocol):
    """What the engine does to one request; called by the scheduler only, never concurrently
    for the same request. Each call leaves its events in ``req.outbox`` and moves ``req.phase``."""

    def advance(self, req: Request) -> None:
        """One step: lookup + restore, a prefill chunk, a token, or the final save."""

    def time_out(self, req: Request) -> None:
        """The deadline passed (no model work: callable without a turn)."""

    def cancel(self, req: Request) -> None:
        """The consumer cancelled (no model work: callable without a turn)."""


class Scheduler:
    __slots__ = ("work", "turns", "_cond", "_ready")

    def __init__(self, work: Work) -> None:
        self.work = work
        self.turns = FairTurns()  # the engine: one step at a time, FIFO among waiting consumers
        self._cond = threading.Condition()  # guards _ready and every request's in_flight
        self._ready: deque[Request] = deque()  # requests whose consumers wait, oldest first

    @property
    def num_waiting(self) -> int:
        return self.turns.num_waiting

    def step(self) -> bool:
        """Advance the requests this step takes (today: the longest-waiting ready one). Call
        with a turn held. False when no request was ready."""
        with self._cond:
            if not self._ready:
                return False
            req = self._ready.popleft()
            req.in_flight = True
        self._run(req, self.work.advance)
        return True

    def events(self, req: Request) -> Iterator[Event]:
        """The consumer's side: ``req``'s events as steps produce them, driving steps while its
        outbox is empty. Raises what a step raised for it. Closing the iterator early abandons
        the request (its lease is released before ``close()`` returns)."""
        try:
            while True:
                # read before draining: another consumer's step may advance this request right
                # now, and a step leaves its events before it marks the request done
                done = req.phase is Phase.DONE
                while req.outbox:
                    item = req.outbox.popleft()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                if done:
                    return
                if req.is_cancelled and req.phase is not Phase.SAVE:
                    self._settle(req, self.work.cancel)  # no turn needed to stop
                else:
                    self._wait_for_progress(req)
        finally:
            self._abandon(req)

    # -- consumers --------------------------------------------------------------------------

    def _wait_for_progress(self, req: Request) -> None:
        with self._cond:
            if not req.in_flight and req not in self._ready:
                self._ready.append(req)
        # the final save has no deadline: the reply is out, the save only helps the next turn
        timeout = None if req.phase is Phase.SAVE else req.time_left()
        try:
            with self.turns.step(None if timeout is None else max(timeout, 0.0)):
                if not req.outbox and req.phase is not Phase.DONE:  # else a step did ours
                    self.step()
        except StepTimeout:
            self._settle(req, self.work.time_out)

    def _settle(self, req: Request, action: Callable[[Request], None]) -> None:
        """Run a no-model ``action`` on ``req`` once no step works on it, and take it out of
        the line. A step that ran meanwhile may have produced events: those are read first."""
        with self._cond:
            self._cond.wait_for(lambda: not req.in_flight)
            if req.outbox or req.phase is Phase.DONE:
                return
            if req in self._ready:
                self._ready.remove(req)
            req.in_flight = True
        self._run(req, action)

    def _abandon(self, req: Request) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not req.in_flight)
            if req in self._ready:
                self._ready.remove(req)
            req.phase = Phase.DONE
        req.release()

    def _run(self, req: Request, action: Callable[[Request], None]) -> None:
        try:
            action(req)
        except Exception as exc:  # delivered to the request's consumer, which raises it
            req.outbox.append(exc)
            req.phase = Phase.DONE
        finally:
            done = req.phase is Phase.DONE
            with self._cond:
                req.in_flight = False
                self._cond.notify_all()
            if done:
                req.release()
