"""Write-behind: one bounded queue drained by one writer thread, and the back-off after errors.

A request never waits on a tier's writes: ``offer`` queues an item or drops it (the queue is
full, by count or by the bytes ``size`` says its items hold: counted by ``on_drop``, the tier's
own counter). Queued blocks live in this process until written, so their bytes are counted
(``num_queued_bytes``) and bounded (``max_bytes``): the tier stack counts them against RAM's
budget. The writer thread hands each item to
``handle``; an exception there goes to ``on_error`` and the thread goes on. Between items it
calls ``idle`` (a tier's chance to reopen its folder or probe its server), which says how long
to wait for the next item. ``Backoff`` is the doubling, capped cool-down both the SSD tier's
writes and the shared tier's link keep after a failure.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from promptcache.core.worker_threads import lower_own_priority, start_thread

__all__ = ["Backoff", "WriteBehind"]

T = TypeVar("T")
_STOP = object()  # the sentinel ``close`` queues: the writer ends after what is before it


class Backoff:
    """After ``failed``, ``is_ready`` is False for a cool-down that doubles with each failure
    in a row (``retry_s``, 2x, 4x, ... capped at ``max_retry_s``); ``succeeded`` ends it."""

    def __init__(self, retry_s: float, max_retry_s: float = 300.0) -> None:
        self.retry_s = retry_s
        self.max_retry_s = max(max_retry_s, retry_s)
        self._lock = threading.Lock()
        self._num_failures = 0
        self._retry_at = 0.0

    @property
    def num_failures(self) -> int:
        """Failures in a row (0: healthy)."""
        return self._num_failures

    def is_ready(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._retry_at

    def seconds_to_retry(self) -> float:
        with self._lock:
            return max(0.0, self._retry_at - time.monotonic())

    def failed(self) -> float:
        """Record a failure; returns the cool-down before the next try."""
        with self._lock:
            self._num_failures += 1
            delay = min(self.retry_s * 2 ** min(self._num_failures - 1, 30), self.max_retry_s)
            self._retry_at = time.monotonic() + delay
            return delay

    def succeeded(self) -> bool:
        """Record a success; True when it ends a run of failures (a recovery)."""
        with self._lock:
            recovered = self._num_failures > 0
            self._num_failures, self._retry_at = 0, 0.0
            return recovered


class WriteBehind(Generic[T]):
    """Invariant: every item ``offer`` accepted is handed to ``handle`` exactly once, in order,
    on the one writer thread (unless ``close`` timed out); ``flush`` returns True only once all
    of them are done; ``num_queued_bytes`` is the ``size`` of those accepted and not yet done
    (the one being handled included)."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], None],
        *,
        max_items: int,
        on_error: Callable[[T, Exception], None],
        on_drop: Callable[[T], None] | None = None,
        idle: Callable[[], float | None] | None = None,
        yields_cpu: bool = False,
        size: Callable[[T], int] | None = None,
    ) -> None:
        self._handle = handle
        self._size = size
        # beyond this many queued bytes an item is dropped (None: bounded by count only); one
        # item is always taken into an empty queue, whatever its size
        self.max_bytes: int | None = None
        self._bytes_lock = threading.Lock()
        self._queued_bytes = 0
        self._on_error = on_error
        self._on_drop = on_drop
        self._idle = idle
        # a local disk's writer may wait for a free core; a network client's must not (its
        # replies time out while it waits)
        self._yields_cpu = yields_cpu
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_items)
        self._closed = False
        self._thread = start_thread(self._loop, name)

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    @property
    def num_queued_bytes(self) -> int:
        return self._queued_bytes

    def offer(self, item: T) -> bool:
        """Queue ``item`` without waiting; False (and ``on_drop``) when full or closed."""
        if not self._closed:
            nbytes = self._size(item) if self._size is not None else 0
            with self._bytes_lock:
                limit = self.max_bytes
                fits = (
                    limit is None or not self._queued_bytes or self._queued_bytes + nbytes <= limit
                )
                if fits:
                    self._queued_bytes += nbytes
            if fits:
                try:
                    self._queue.put_nowait(item)
                    return True
                except queue.Full:
                    self._release(nbytes)
        if self._on_drop is not None:
            self._on_drop(item)
        return False

    def flush(self, timeout: float = 30.0, poll_s: float = 0.002) -> bool:
        """Wait until every queued item is handled; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(poll_s)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Handle what is queued, then stop the writer (waiting up to ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return  # a writer stuck this long: it is a daemon thread, let it go
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        if self._yields_cpu:
            lower_own_priority()  # deferred by design: the steps' cores come first
        while True:
            wait = self._idle() if self._idle is not None else None
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is _STOP:
                self._queue.task_done()
                return
            try:
                self._handle(item)  # type: ignore[arg-type]
            except Exception as exc:  # a tier's error must never end its writer
                self._on_error(item, exc)  # type: ignore[arg-type]
            finally:
                if self._size is not None:
                    self._release(self._size(item))  # type: ignore[arg-type]
                self._queue.task_done()

    def _release(self, nbytes: int) -> None:
        with self._bytes_lock:
            self._queued_bytes -= nbytes
