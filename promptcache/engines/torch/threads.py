"""torch's intra-op threads, following what the machine is doing (``--threads``, default auto).

A thread pool spanning every core stalls at each op's barrier whenever another process holds a
core; one thread leaves a free core idle. So the default counts the cores this process may use,
subtracts what *other* processes keep busy (at start: the load average; then every
``RECHECK_S`` seconds: the machine's busy time from ``/proc/stat`` minus this process's own CPU
time over the window) and uses the rest, at least one. A fixed ``--threads N`` is set once per thread that runs forwards.

Every other thread runs torch on one (``hold_one_thread``: the loading thread, and each
background thread through ``core.worker_threads``): a second thread that ran torch ops on N
threads keeps a second OpenMP team, and with more OpenMP threads than cores libgomp stops
spinning between parallel regions; the stepping thread's 2-thread decode then measured ~30%
slower here (26 vs 38 tok/s on the bundled model).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from promptcache.core.figures import Series, Snapshot

RECHECK_S = 2.0  # how often the auto default looks again (a forward on 135M is ~10-70 ms)
# cores of other work tolerated before a thread is given up to it: a step on 2 threads beside a
# process keeping 0.3 of a core busy still ran 1.24-1.47x faster than on 1, at 0.5 0.84-0.86x
# (benchmarks/threads_bench.py); at 0.25 an agent client's own streaming cost a whole core
SLACK = 0.4
SHORT_WINDOWS = 2  # re-checks in a row that must ask for fewer threads before one is given up


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_for(cores: int, others_busy: float) -> int:
    """Threads for ``cores`` usable cores while other processes keep ``others_busy`` cores
    busy: every core not taken by them (a fraction above ``SLACK`` counts as a whole core)."""
    taken = max(0, math.ceil(others_busy - SLACK))
    return max(1, cores - taken)


def read_cpu_times() -> tuple[float, float] | None:
    """(busy, total) seconds of the whole machine since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = sum(ticks) / hz
    return total - (ticks[3] + ticks[4]) / hz, total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ThreadTuner:
    """Sets torch's intra-op threads from the thread that runs forwards (``apply`` before each
    one; cheap: a clock read unless a re-check is due). ``fixed``: that many, set once;
    None: the adaptive default."""

    def __init__(
        self,
        fixed: int | None = None,
        *,
        cores: int | None = None,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fixed = fixed
        self.cores = cores or usable_cores()
        self._set = set_threads or _torch_set_threads
        self._clock = clock
        self.threads = fixed or self.initial()
        self._applied = threading.local()  # the count set in each thread (torch's is per thread)
        self._sample = self._take_sample()
        self.num_changes = 0
        self._num_short = 0  # windows in a row that asked for fewer threads

    def initial(self) -> int:
        """At start this process does nothing yet: the load average is the others' load."""
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return max(1, self.cores - 1)
        total = os.cpu_count() or self.cores
        return threads_for(self.cores, load * self.cores / max(total, self.cores))

    @property
    def most_threads(self) -> int:
        """The most threads it sets: what forwards run on while the machine is otherwise idle."""
        return self.fixed or self.cores

    def apply(self) -> int:
        """The thread count in force for the next forward (set now if it changed)."""
        if self.fixed is None and self._clock() - self._sample[0] >= RECHECK_S:
            self._recheck()
        if getattr(self._applied, "threads", None) != self.threads:
            self._set(self.threads)
            self._applied.threads = self.threads
        return self.threads

    def _take_sample(self) -> tuple[float, tuple[float, float] | None, float]:
        return self._clock(), read_cpu_times(), own_cpu_seconds()

    def _recheck(self) -> None:
        prev, now = self._sample, self._take_sample()
        self._sample = now
        if prev[1] is None or now[1] is None:
            return  # no /proc/stat: keep the start-up choice
        busy, total = now[1][0] - prev[1][0], now[1][1] - prev[1][1]
        wall = now[0] - prev[0]
        if total <= 0 or wall <= 0:
            return
        machine_cores = os.cpu_count() or self.cores
        machine_busy = busy / total * machine_cores  # cores kept busy, on average
        own = (now[2] - prev[2]) / wall
        others = max(0.0, machine_busy - own) * self.cores / max(machine_cores, self.cores)
        self.decide(others)

    def decide(self, others: float) -> int:
        """The threads after a window in which other processes kept ``others`` cores busy:
        more at once, fewer only after ``SHORT_WINDOWS`` windows in a row asked for fewer (an
        agent client composing its next turns keeps half a core busy for a second or two, and
        the forward that follows a drop can run 10-20 s on the lone thread)."""
        wanted = threads_for(self.cores, others)
        self._num_short = self._num_short + 1 if wanted < self.threads else 0
        if wanted > self.threads or self._num_short >= SHORT_WINDOWS:
            self.threads, self._num_short = wanted, 0
            self.num_changes += 1
        return self.threads

    def stats(self) -> Snapshot:
        """The threads in force, and how often the adaptive default changed them."""
        return thread_figures(self.threads, self.num_changes)

    def describe(self) -> str:
        mode = "fixed" if self.fixed is not None else "auto"
        return f"{self.threads} ({mode}, {self.cores} cores)"


def thread_figures(threads: int, num_changes: int = 0) -> Snapshot:
    """The ``compute`` family: torch's intra-op threads in force, and how often they changed."""
    values = {"torch_threads": threads, "thread_changes": num_changes}
    series = (
        Series("torch_threads", "gauge", threads),
        Series("thread_changes", "counter", num_changes),
    )
    return Snapshot(values, series)


def _torch_set_threads(n: int) -> None:
    import torch

    # a thread's first parallel op sets its count to the last one any thread set: settle that
    # first, or it would later overwrite ours
    torch.get_num_threads()
    torch.set_num_threads(n)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The calling thread's torch threads at ``n`` for the block, then back."""
    import torch

    before = torch.get_num_threads()
    _torch_set_threads(n)
    try:
        yield
    finally:
        _torch_set_threads(before)


def hold_one_thread() -> None:
    """One torch thread for the calling thread: the loading thread and every background thread
    (``core.worker_threads``); forwards get theirs from ``apply`` on the thread that runs them."""
    _torch_set_threads(1)


def make_thread_tuner(threads: int | None) -> ThreadTuner | None:
    """``--threads``: 0 leaves torch's own default (one per core), N fixes N, None the adaptive
    default (unless ``OMP_NUM_THREADS`` is set: then torch's, which reads it)."""
    if threads == 0 or (threads is None and os.environ.get("OMP_NUM_THREADS")):
        return None
    if threads is not None and threads < 0:
        from promptcache.errors import ConfigError

        raise ConfigError(f"--threads {threads}: use 0 (torch's default), N > 0, or leave unset")
    return ThreadTuner(threads)
