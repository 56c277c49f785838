"""What runs at the start of every background thread promptcache starts (``start_thread``,
``worker_initializer`` for executors): engines register their per-thread set-up here without
the core knowing them.

The torch engine registers one intra-op thread per background thread: a writer or reader that
ran a torch op on torch's default (one thread per core) keeps a second OpenMP team alive, and
with more OpenMP threads than cores libgomp stops spinning between parallel regions, for every
team; the stepping thread's decode then ran ~20% slower (25 vs 30 ms a token here).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

BACKGROUND_NICE = 10  # added to a deferred writer's niceness (CFS gives it ~1/10 of a core)
_hooks: list[Callable[[], None]] = []


def add_start_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the start of every background thread started from now on; adding the
    same hook twice is a no-op."""
    if hook not in _hooks:
        _hooks.append(hook)


def worker_initializer() -> None:
    """The hooks, in order: a thread's first call (``ThreadPoolExecutor(initializer=...)``)."""
    for hook in list(_hooks):
        hook()


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A started daemon thread running the hooks, then ``target``."""

    def run() -> None:
        worker_initializer()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def lower_own_priority() -> bool:
    """Make the calling thread yield the CPU to the rest (its niceness raised by
    ``BACKGROUND_NICE``; on Linux a thread's own): a deferred writer that preempts one of the stepping thread's
    OpenMP threads stalls the whole team at its next barrier. False where it cannot (another
    OS, a sandbox that refuses)."""
    if not sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        return False
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICE))
    except OSError:
        return False
    return True
