"""Process memory: the resident set size, and glibc's allocator told when to map buffers and
when to give freed memory back.

Why: glibc raises its mmap threshold each time a large mmapped buffer is freed (up to 32 MB),
so after the first batch buffers come and go, every KV buffer below that size is carved from
the heap arenas and stays resident once freed: under 12 concurrent sessions that kept RSS
1.2 GB above the live state. A fixed 1 MiB threshold gave them back, but then every buffer from
1 MiB up (a restored context's layers, a row's growth, a block copy) came as fresh pages: under
32 agent sessions 7M page faults in two minutes, a tenth of the stepping threads' time in the
kernel. So the threshold is fixed at 32 MiB (freed buffers are reused while the load lasts) and
the heap is trimmed (``HeapTrim``) once the engine has stayed idle a while (what the load freed
leaves; the gaps of an agent's tool calls keep it), and under load whenever RSS passes what the
engine can account for (the RAM budget, the live requests' state, the process at start).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol


class FreePool(Protocol):
    """Buffers of its own that a pool keeps for reuse once freed (``engines/torch/buffers``)."""

    num_free_bytes: int  # the free buffers' bytes, waiting for reuse (resident)
    spare: Callable[[], int] | None  # bytes free buffers may also take (``share_spare``)
    reserve_bytes: int  # free bytes an idle trim leaves (``reserve_pools``)

    def release_free(self, keep_bytes: int = 0) -> int:
        """Give free buffers back to the system until ``keep_bytes`` are left; the bytes
        released. Safe to call twice."""
        ...

    def reserve(self, nbytes: int) -> int:
        """Keep ``nbytes`` of free buffers faulted in (within its bound); the bytes mapped."""
        ...


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # only buffers past glibc's own dynamic ceiling are mapped
TRIM_THRESHOLD_BYTES = 64 << 20  # free() returns the heap's top past this; trim_heap the rest

IDLE_TRIM_S = 2.0  # idle this long ends a load; trimming every short gap faults pages in again
# under load, RSS against the allowance at most this often (a ~10 us /proc read: about every
# step; once a second let 12 sessions on a 32 MB budget pass it by up to ~100 MB between checks)
CHECK_S = 0.02

_lock = threading.Lock()
_is_tuned = False
_libc: ctypes.CDLL | None = None
_pools: list[FreePool] = []
_spare: Callable[[], int] | None = None


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds, once per process; False where it is not glibc."""
    global _is_tuned, _libc
    with _lock:
        if _is_tuned:
            return True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is None or getattr(libc, "malloc_trim", None) is None:
            return False
        _is_tuned = bool(
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
        _libc = libc if _is_tuned else None
        return _is_tuned


def add_pool(pool: FreePool) -> None:
    """Have ``trim_heap`` release ``pool``'s free buffers too (and ``pooled_free_bytes`` count
    them). Safe to call twice with the same pool."""
    with _lock:
        if all(p is not pool for p in _pools):
            _pools.append(pool)
            if _spare is not None:
                pool.spare = _spare


def share_spare(method: Callable[[], int]) -> None:
    """Let every pool (now and later) keep free buffers in ``method()`` bytes as well: what the
    RAM tier's budget leaves unused (a trim under load releases them once RSS passes what the
    engine accounts for). ``method`` is a bound method, held weakly (0 once its object is
    gone). Calling again replaces it."""
    global _spare
    ref = weakref.WeakMethod(method)

    def spare() -> int:
        bound = ref()
        return bound() if bound is not None else 0

    with _lock:
        _spare = spare
        for p in _pools:
            p.spare = spare


def pooled_free_bytes() -> int:
    """Bytes the pools (``add_pool``) keep free for reuse."""
    return sum(p.num_free_bytes for p in list(_pools))


def reserve_pools(nbytes: int) -> int:
    """Have every pool keep ``nbytes`` of free buffers faulted in, through idle trims (each
    within its bound on free bytes); the bytes mapped."""
    return sum(p.reserve(nbytes) for p in list(_pools))


def trim_heap(keep_reserve: bool = False) -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; every arena),
    and every pool's free buffers (``add_pool``; ``keep_reserve``: all but its reserve): after
    a load, the buffers it freed stop counting in RSS. Safe from any thread, at any time
    (later allocations fault their pages in again). True when some memory was released."""
    released = sum(p.release_free(p.reserve_bytes if keep_reserve else 0) for p in list(_pools))
    libc = _libc
    trimmed = bool(libc.malloc_trim(0)) if libc is not None else False
    return trimmed or released > 0


class HeapTrim:
    """When freed heap pages go back to the system (``trim_heap``). The scheduler calls
    ``on_idle`` as its stepping thread ends: a trim once ``idle_s`` has passed with
    ``is_idle()`` still true (each call restarts the wait). It calls ``after_step`` after every
    step: at most every ``check_s``, a trim when RSS is above ``allowance()`` bytes (what the
    engine can account for), asked only once RSS is above ``floor()``, a cheap lower bound of
    it. Safe from any thread; ``num_trims`` counts the trims done."""

    def __init__(
        self,
        is_idle: Callable[[], bool],
        allowance: Callable[[], int] | None = None,
        idle_s: float = IDLE_TRIM_S,
        check_s: float = CHECK_S,
        floor: Callable[[], int] = lambda: 0,
    ) -> None:
        self.is_idle = is_idle
        self.allowance = allowance
        self.floor = floor
        self.idle_s = idle_s
        self.check_s = check_s
        self.num_trims = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._next_check = 0.0

    def on_idle(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.idle_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def after_step(self) -> None:
        if self.allowance is None:
            return
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + self.check_s
        rss = rss_bytes()
        if rss > self.floor() and rss > self.allowance():
            self._trim()

    def _fire(self) -> None:
        if self.is_idle():
            self._trim(keep_reserve=True)  # the next load's first buffers, already faulted in

    def _trim(self, keep_reserve: bool = False) -> None:
        trim_heap(keep_reserve)
        with self._lock:
            self.num_trims += 1
