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


def test_queued_bytes_are_counted_until_written_and_bounded():
    gate = threading.Event()
    written: list[int] = []
    dropped: list[int] = []

    def handle(n: int) -> None:
        gate.wait(10)
        written.append(n)

    writer: WriteBehind[int] = WriteBehind(
        "test-writer", handle, max_items=64, on_error=lambda item, exc: None,
        on_drop=dropped.append, size=lambda n: n,
    )  # fmt: skip
    writer.max_bytes = 100
    assert writer.offer(300)  # an empty queue takes one item, whatever its size
    assert not writer.offer(1)  # the one being written still counts
    assert writer.num_queued_bytes == 300 and dropped == [1]
    gate.set()
    assert writer.flush(timeout=10)
    assert writer.num_queued_bytes == 0
    gate.clear()
    assert writer.offer(60) and writer.offer(40)
    assert not writer.offer(10)  # 60 + 40 + 10 > 100
    assert writer.num_queued_bytes == 100 and dropped == [1, 10]
    writer.max_bytes = None  # bounded by count only
    assert writer.offer(10**9)
    gate.set()
    assert writer.flush(timeout=10)
    writer.close()
    assert written == [300, 60, 40, 10**9] and writer.num_queued_bytes == 0
