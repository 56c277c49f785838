"""The scheduler: which requests the engine advances, one ``step()`` at a time.

Policy: continuous batching (``batching.Batcher`` composes a step). Every active request whose
consumer keeps up (fewer than ``MAX_BACKLOG`` unread events: backpressure, as a generator's
would be) moves in every step: requests join at the step after they arrive and leave when they
finish; decoding requests share one forward, prefill chunks share a token budget.

Nobody runs a loop of steps: the consumers drive. A consumer with no events to read registers
its request, takes a turn on the engine (``FairTurns``: FIFO, with the request's deadline) and
runs ``step()``, unless a step meanwhile left events for it; every request the step advanced
finds its events in its outbox. A consumer that times out, is cancelled or walks away settles
its own request without a turn, once no step is working on it (``in_flight``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from promptcache.engines.base import Event
from promptcache.engines.request import Phase, Request
from promptcache.engines.turns import FairTurns, StepTimeout

MAX_BACKLOG = 64  # unread events at which a request stops moving until its consumer reads


class Work(Protocol):
    """What the engine does to requests; called by the scheduler only, never concurrently for
    the same request. Each call leaves its events in ``req.outbox`` and moves ``req.phase``."""

    def advance_batch(self, reqs: Sequence[Request]) -> None:
        """One step of every request in ``reqs`` (lookup + restore, a prefill chunk, a token
        or the final save each); a request's error goes to its outbox, never raised."""

    def time_out(self, req: Request) -> None:
        """The deadline passed (no model work: callable without a turn)."""

    def cancel(self, req: Request) -> None:
        """The consumer cancelled (no model work: callable without a turn)."""


class Scheduler:
    __slots__ = ("work", "turns", "_cond", "_active")

    def __init__(self, work: Work) -> None:
        self.work = work
        self.turns = FairTurns()  # the engine: one step at a time, FIFO among waiting consumers
        self._cond = threading.Condition()  # guards _active and every request's in_flight
        self._active: list[Request] = []  # registered and not done, in arrival order

    @property
    def num_waiting(self) -> int:
        return self.turns.num_waiting

    def step(self) -> bool:
        """Advance every active request that is not backlogged, in one batched step. Call with
        a turn held. False when no request could move."""
        with self._cond:
            self._active = [r for r in self._active if r.phase is not Phase.DONE]
            batch = [r for r in self._active if not r.in_flight and len(r.outbox) < MAX_BACKLOG]
            if not batch:
                return False
            for req in batch:
                req.in_flight = True
        try:
            self.work.advance_batch(batch)
        except Exception as exc:  # a bug outside any one request's part: all of them fail
            for req in batch:
                if req.phase is not Phase.DONE:
                    req.outbox.append(exc)
                    req.phase = Phase.DONE
        finally:
            with self._cond:
                for req in batch:
                    req.in_flight = False
                self._cond.notify_all()
            for req in batch:
                if req.phase is Phase.DONE:
                    req.release()
        return True

    def wake(self) -> None:
        """A step left events before its end: their consumers stop waiting for a turn."""
        self.turns.wake()

    @property
    def num_active(self) -> int:
        with self._cond:
            return sum(r.phase is not Phase.DONE for r in self._active)

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
            if req not in self._active:
                self._active.append(req)
        # the final save has no deadline: the reply is out, the save only helps the next turn
        timeout = None if req.phase is Phase.SAVE else req.time_left()
        # a step running now may leave this request events mid-way (its first token comes out
        # before that step's decode forward): then the consumer leaves the line to read them
        ready = lambda: bool(req.outbox) or req.phase is Phase.DONE  # noqa: E731
        try:
            with self.turns.step(None if timeout is None else max(timeout, 0.0), ready) as held:
                if held and not ready():  # else a step did ours
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
            req.in_flight = True
        self._run(req, action)

    def _abandon(self, req: Request) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not req.in_flight)
            if req in self._active:
                self._active.remove(req)
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
