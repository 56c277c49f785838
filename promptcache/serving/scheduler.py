"""The scheduler: which requests the engine advances, one ``step()`` at a time.

Policy: continuous batching (``batching.Batcher`` composes a step). Every active request whose
consumer keeps up (fewer than ``MAX_BACKLOG`` unread events: backpressure, as a generator's
would be) moves in every step: requests join at the step after they arrive and leave when they
finish; decoding requests share one forward, prefill chunks share a token budget.

One stepping thread per scheduler runs the steps, started when a request registers and gone
when none is active; it holds the engine's ``FairTurns`` for each step (``CachedEngine.prefill``
takes turns too). The scheduler alone changes a request's ``phase`` and fills its ``outbox``:
steps return what happened (``Moved``) and ``_apply`` applies it. Consumers only wait for their
request's events: a step that completes a prompt hands its events over right then
(``deliver``), so the first token streams while that step's decode forward runs. A consumer that times out, is cancelled or walks away settles its own
request without the engine, once no step is working on it (``in_flight``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from promptcache.core.figures import Series, Snapshot
from promptcache.core.worker_threads import start_thread
from promptcache.errors import EngineFailure, RequestError
from promptcache.serving.events import Event
from promptcache.serving.request import Moved, Phase, Request
from promptcache.serving.turns import FairTurns

MAX_BACKLOG = 64  # unread events at which a request stops moving until its consumer reads
POLL_S = 0.25  # how often a waiting consumer re-checks its cancel flag (set by other threads)
log = logging.getLogger("promptcache")


class StepFailure(EngineFailure):
    """A bug in a step, not in any one request: every request in that step ends with it (a 500
    in its API's error shape); the cause is in the server's log once, with its traceback."""


class Work(Protocol):
    """What the engine does to requests; called by the scheduler only, never concurrently for
    the same request. Each call returns what happened (a ``Moved``: the events for the
    consumer and where the request goes next, a phase or the error that ends it); the scheduler
    applies it (``_apply``): it alone fills ``req.outbox`` and moves ``req.phase``."""

    def advance_batch(self, reqs: Sequence[Request]) -> dict[Request, Moved]:
        """One step of every request in ``reqs`` (lookup + restore, a prefill chunk, a token
        or the final save each): what happened to each request that moved or failed (a
        request's error is its outcome, never raised)."""

    def time_out(self, req: Request) -> Moved:
        """The deadline passed (no model work: callable without a turn)."""

    def cancel(self, req: Request) -> Moved:
        """The consumer cancelled (no model work: callable without a turn)."""


class Scheduler:
    __slots__ = (
        "work", "turns", "_cond", "_active", "_is_stepping", "check_state", "admits",
        "_needs_check", "num_step_failures", "num_integrity_failures", "num_admission_waits",
        "on_idle", "after_step",
    )  # fmt: skip

    def __init__(
        self,
        work: Work,
        check_state: Callable[[], None] | None = None,
        admits: Callable[[Request, Sequence[Request]], bool] | None = None,
    ) -> None:
        """``check_state``: raises AssertionError when the state the steps share (the cache's
        books) is inconsistent; run after a step failed, before the next step. ``admits(new,
        running)``: whether a request not started yet may start beside the running ones (it
        waits otherwise; one always runs)."""
        self.work = work
        self.check_state = check_state
        self.admits = admits
        # called by the stepping thread after each step and as it ends (no request left),
        # outside every lock; housekeeping (a failure is logged, never a request's)
        self.after_step: Callable[[], object] = _nothing
        self.on_idle: Callable[[], object] = _nothing
        self.num_admission_waits = 0  # steps a new request waited for room (``admits``)
        self._needs_check = False
        self.num_step_failures = 0  # steps that raised outside any request's own part
        self.num_integrity_failures = 0  # checks after such a step that found damage
        self.turns = FairTurns()  # the engine: one step at a time, FIFO among waiting consumers
        self._cond = threading.Condition()  # guards _active and every request's in_flight
        self._active: list[Request] = []  # registered and not done, in arrival order
        self._is_stepping = False  # the stepping thread runs (guarded by _cond)

    @property
    def num_waiting(self) -> int:
        return self.turns.num_waiting

    def step(self) -> bool:
        """Advance every active request that is not backlogged, in one batched step. Call with
        a turn held. False when no request could move."""
        with self._cond:
            self._active = [r for r in self._active if r.phase is not Phase.DONE]
            batch = [r for r in self._active if not r.in_flight and len(r.outbox) < MAX_BACKLOG]
            if self.admits is not None:
                batch = self._admitted(batch)
            if not batch:
                return False
            for req in batch:
                req.in_flight = True
        try:
            for req, moved in self.work.advance_batch(batch).items():
                outcome = moved.outcome
                if isinstance(outcome, Exception) and _is_bug(outcome):  # an unplanned raise
                    moved = Moved(self._failed(outcome), moved.events)
                _apply(req, moved)
        except Exception as exc:  # a bug outside any one request's part: all of them fail
            failure = self._failed(exc)
            for req in batch:
                if req.phase is not Phase.DONE:
                    _apply(req, Moved(failure))
        finally:
            with self._cond:
                for req in batch:
                    req.in_flight = False
                self._cond.notify_all()
            for req in batch:
                if req.phase is Phase.DONE:
                    self._release(req)
        return True

    def _admitted(self, batch: list[Request]) -> list[Request]:
        """``batch`` less the new requests that must wait for room, in arrival order (caller
        holds ``_cond``)."""
        assert self.admits is not None
        running = [r for r in self._active if r.phase not in (Phase.NEW, Phase.DONE)]
        out = []
        for req in batch:
            if req.phase is Phase.NEW:
                if running and not self.admits(req, running):
                    self.num_admission_waits += 1
                    continue
                running.append(req)
            out.append(req)
        return out

    def _failed(self, exc: BaseException) -> StepFailure:
        """Log a step's failure once with its traceback, count it, and have the shared state
        checked before the next step; what the requests it held end with."""
        log.error("an engine step failed: %r", exc, exc_info=exc)
        with self._cond:
            self.num_step_failures += 1
            self._needs_check = True
        failure = StepFailure(
            f"the engine failed while serving this request ({type(exc).__name__})"
        )
        failure.__cause__ = exc
        return failure

    def _release(self, req: Request) -> None:
        try:
            req.release()
        except Exception as exc:  # the cache's books: never kills the stepping thread
            self._failed(exc)

    def _check_after_failure(self) -> None:
        """Before the next step after a failed one: check the shared state, once."""
        with self._cond:
            if not self._needs_check:
                return
            self._needs_check = False
        if self.check_state is None:
            return
        try:
            self.check_state()
        except Exception as exc:
            log.error("state check after a failed step found damage: %r", exc, exc_info=exc)
            with self._cond:
                self.num_integrity_failures += 1

    def live_states(self) -> list[object]:
        """The model state of every request started and not done (for memory figures)."""
        with self._cond:
            return [
                r.state for r in self._active if r.phase is not Phase.DONE and r.state is not None
            ]

    def stats(self) -> Snapshot:
        with self._cond:
            counts = {
                "num_step_failures": self.num_step_failures,
                "num_integrity_failures": self.num_integrity_failures,
                "num_admission_waits": self.num_admission_waits,
            }
        return Snapshot(counts, tuple(Series(k, "counter", v) for k, v in counts.items()))

    def deliver(self, ready: Mapping[Request, Moved]) -> bool:
        """Events a step produced before its end, to their consumers now (their outcomes are
        applied with the rest of the step). True: delivered."""
        for req, moved in ready.items():
            req.outbox.extend(moved.events)
        with self._cond:
            self._cond.notify_all()
        return True

    @property
    def num_active(self) -> int:
        with self._cond:
            return sum(r.phase is not Phase.DONE for r in self._active)

    def events(self, req: Request) -> Iterator[Event]:
        """The consumer's side: ``req``'s events as steps produce them (the stepping thread runs
        them), waiting while its outbox is empty. Raises what a step raised for it. Closing the iterator early abandons
        the request (its lease is released before ``close()`` returns)."""
        try:
            while True:
                # read before draining: a step may advance this request right now, and a step leaves its events before it marks the request done
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
        """Register ``req`` and wait until a step leaves it events (or it is done); past its
        deadline (the final save has none) it is settled as timed out."""
        deadline = None if req.phase is Phase.SAVE else req.deadline
        with self._cond:
            if req not in self._active:
                self._active.append(req)
            self._cond.notify_all()  # an idle stepping thread: a newcomer or a drained backlog
            while not (req.outbox or req.phase is Phase.DONE or req.is_cancelled):
                self._ensure_stepping()  # also after a stepping thread died of a bug
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(POLL_S if left is None else min(left, POLL_S))
            else:
                return
        self._settle(req, self.work.time_out)

    def _ensure_stepping(self) -> None:
        """Start the stepping thread unless it runs (caller holds ``_cond``)."""
        if not self._is_stepping:
            self._is_stepping = True
            start_thread(self._run_steps, "promptcache-steps")

    def _run_steps(self) -> None:
        """The stepping thread: a step whenever some active request can move; it ends when
        none is active (the next registration starts another)."""
        try:
            while self._wait_for_work():
                self._check_after_failure()
                with self.turns.step():
                    has_moved = self.step()
                self._housekeep(self.after_step)
                if not has_moved:  # what can move waits for room or for its reader
                    with self._cond:
                        self._cond.wait(POLL_S)
        except BaseException:  # not step()'s (it keeps errors with their requests): restartable
            with self._cond:
                self._is_stepping = False
                self._cond.notify_all()
            raise
        self._housekeep(self.on_idle)

    def _housekeep(self, hook: Callable[[], object]) -> None:
        try:
            hook()
        except Exception as exc:  # never an error for a request, never the thread's end
            log.warning("the engine's housekeeping hook failed: %r", exc)

    def _wait_for_work(self) -> bool:
        """Until some active request can move (True); False, and the thread is no longer the
        stepping one, once none is active."""
        with self._cond:
            while not self._can_step():
                if not any(r.phase is not Phase.DONE for r in self._active):
                    self._is_stepping = False
                    return False
                self._cond.wait(POLL_S)
        return True

    def _can_step(self) -> bool:
        return any(
            r.phase is not Phase.DONE and not r.in_flight and len(r.outbox) < MAX_BACKLOG
            for r in self._active
        )

    def _settle(self, req: Request, action: Callable[[Request], Moved]) -> None:
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
        self._release(req)

    def _run(self, req: Request, action: Callable[[Request], Moved]) -> None:
        try:
            _apply(req, action(req))
        except Exception as exc:  # delivered to the request's consumer, which raises it
            _apply(req, Moved(exc))
        finally:
            done = req.phase is Phase.DONE
            with self._cond:
                req.in_flight = False
                self._cond.notify_all()
            if done:
                self._release(req)


def _nothing() -> None:
    return None


def _is_bug(outcome: object) -> bool:
    """An outcome no API maps to a planned answer: not the client's fault (``RequestError``),
    not a failure the engine already named (``EngineFailure``)."""
    return isinstance(outcome, Exception) and not isinstance(outcome, RequestError | EngineFailure)


def _apply(req: Request, moved: Moved) -> None:
    """The one place a request's outbox fills and its phase moves: the step's events, then the
    outcome (an error goes to its consumer and ends it)."""
    outcome = moved.outcome
    if moved.events:
        req.outbox.extend(moved.events)
    if isinstance(outcome, BaseException):
        req.outbox.append(outcome)
        req.phase = Phase.DONE
    else:
        req.phase = outcome
