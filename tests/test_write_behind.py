"""The deferred writer (``WriteBehind``): every accepted item handled once, in order, on its own
thread, and that thread yields the CPU to the stepping thread (a higher niceness)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from promptcache.core.tiers.write_behind import WriteBehind


def test_items_are_handled_in_order_on_one_thread():
    seen: list[tuple[int, int]] = []
    writer: WriteBehind[int] = WriteBehind(
        "test-writer", lambda i: seen.append((i, threading.get_ident())), max_items=64,
        on_error=lambda item, exc: None,
    )  # fmt: skip
    for i in range(50):
        assert writer.offer(i)
    assert writer.flush(timeout=10)
    writer.close()
    assert [i for i, _ in seen] == list(range(50))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_writer_thread_runs_at_a_lower_priority_than_the_caller():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if mine >= 19:
        pytest.skip("already at the lowest priority")
    niceness: list[int] = []
    writer: WriteBehind[int] = WriteBehind(
        "test-writer",
        lambda _: niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        max_items=4,
        on_error=lambda item, exc: None,
        yields_cpu=True,
    )
    writer.offer(1)
    assert writer.flush(timeout=10)
    writer.close()
    assert niceness and niceness[0] > mine
    # only the writer's own thread: this process's other threads keep theirs
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
