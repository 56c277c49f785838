"""An engine's memory books: what it accounts for (the live requests' state, the RAM tier's
blocks and budget, the queued writes, the process at start) and, from those, when its heap is
trimmed under load and how much room freed KV buffers may keep (``memory``)."""

from __future__ import annotations

import logging
from typing import Any

from promptcache.core.budget import available_ram_bytes, format_size
from promptcache.serving.memory import (
    HeapTrim,
    pooled_free_bytes,
    reserve_pools,
    rss_bytes,
    share_spare,
    tune_malloc,
)
from promptcache.serving.runner import DeviceMemory, ModelRunner
from promptcache.serving.scheduler import Scheduler

log = logging.getLogger("promptcache")

# allocator overhead allowed beyond the accounted (a step's kernels and buffers are in the
# process at start: the warm-up). memory_bench on a 32 MB RAM tier, checked every 20 ms, peak RSS
# past live + budget at 12 sessions: medians -1 MB at 4 MiB (7 runs), +2.5 at 0 (12), +17 at
# 16 MiB (7), in the same time; 0 would trim each check for the runtime's own growth
RSS_SLACK_BYTES = 4 << 20
# KV buffers faulted in at start and kept through idle trims, within the RAM budget's unused
# part (``BufferPool.reserve``): 16 sessions' first turns on a VM, the last first token 0.9 s
# sooner with 268 MB (of the ~450 MB their restores took)
RESERVE_BYTES = 256 << 20
# the running requests' state at most by default (``--max-live-bytes``): this share of what the
# device has left once the model is loaded and warmed up (on a CPU, what the RAM tier may still
# take aside), so that many long sessions queue rather than swap or meet the OOM killer
LIVE_SHARE = 0.8
MIN_LIVE_SHARE = 0.25  # of the RAM, whatever the RAM tier's budget


def default_live_cap(cache: Any, runner: ModelRunner) -> int:
    """``LIVE_SHARE`` of the memory the running requests' state may take: the device's free
    memory where the runner's state is on one (``DeviceMemory``), else the RAM this process can
    still take (``available_ram_bytes``: a container's limit too) less the part of the RAM
    tier's budget it does not hold yet, but never under ``MIN_LIVE_SHARE`` of that RAM (a
    budget set near or past it would otherwise serve one request at a time). Read once, at
    start."""
    free = runner.device_free_bytes() if isinstance(runner, DeviceMemory) else None
    if free is not None:
        return int(max(0, free) * LIVE_SHARE)
    ram = available_ram_bytes()
    to_come = cache.ram.budget_bytes - cache.ram.held_bytes if cache is not None else 0
    if ram - to_come < ram * MIN_LIVE_SHARE / LIVE_SHARE:
        log.warning(
            "the RAM tier's budget (%s) leaves the running requests little of the %s this "
            "process can take: their state is capped at %s; a smaller --ram-budget leaves them "
            "more",
            format_size(to_come),
            format_size(ram),
            format_size(ram * MIN_LIVE_SHARE),
        )
    return int(max(ram * MIN_LIVE_SHARE, (ram - to_come) * LIVE_SHARE))


class MemoryBooks:
    """Set up once per engine, after its scheduler: tunes malloc, takes the process's RSS before
    any request, hooks the heap trim (``heap``) on the scheduler, lends pools the RAM
    budget's unused part, and has them fault a reserve in (``RESERVE_BYTES``) where the
    runner's KV is pooled (a CPU device). ``cache`` is the engine's prompt cache, or None when
    it is off."""

    def __init__(self, cache: Any, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.cache, self.runner, self.scheduler = cache, runner, scheduler
        tune_malloc()
        # what a load freed leaves once it is over, or when RSS passes what is accounted for
        self.base_rss = rss_bytes()  # the model and the process, before any request
        self.heap = HeapTrim(
            lambda: scheduler.num_active == 0, self.rss_allowance, floor=self.rss_floor
        )
        if cache is not None:  # freed KV buffers wait for reuse in the budget's unused part
            share_spare(self.spare_budget_bytes)
            if getattr(getattr(runner, "device", None), "type", None) == "cpu":  # pooled: CPU KV
                reserve_pools(RESERVE_BYTES)  # and some are faulted in before the first request
        scheduler.on_idle = self.heap.on_idle
        scheduler.after_step = self.heap.after_step

    def rss_allowance(self) -> int:
        """What RSS may reach before the heap is trimmed under load: the process at start, the
        RAM tier's budget, the running requests' state, and ``RSS_SLACK_BYTES``. The budget, not
        what the tier holds: trimming down to its blocks cost 32 agent sessions ~10% of their
        tokens/s (each trim's pages fault back in) for ~1 GiB less RSS (``load_bench``)."""
        return self.rss_floor() + self.runner.held_bytes(self.scheduler.live_states())

    def rss_floor(self) -> int:
        """``rss_allowance`` without the running requests' state: a lower bound of it that
        needs no walk over their buffers (below it, nothing is to be trimmed)."""
        ram = self.cache.ram.budget_bytes if self.cache is not None else 0
        return self.base_rss + ram + RSS_SLACK_BYTES

    def spare_budget_bytes(self) -> int:
        """What the RAM tier's budget leaves unused (its blocks and the queued writes aside)."""
        cache = self.cache
        if cache is None:
            return 0
        ram = cache.ram
        return max(0, ram.budget_bytes - ram.held_bytes - cache.tiers.queued_bytes())

    def stats(self, max_live_bytes: int) -> dict[str, int]:
        """Where the process's memory is: the running requests' model state (with the decode
        batch), the RAM tier's blocks and the queued block writes (both within its budget), the
        resident set, and the resident set before any request (the model and the runtime):
        ``rss_bytes`` less those is what nothing accounts for (heap between trims, kernels'
        caches, a step's buffers)."""
        live = self.scheduler.live_states()
        cache = self.cache
        return {
            "live_requests": len(live),
            "live_state_bytes": self.runner.held_bytes(live),
            "ram_held_bytes": cache.ram.held_bytes if cache is not None else 0,
            "ram_budget_bytes": cache.ram.budget_bytes if cache is not None else 0,
            # inside the RAM budget (the RAM tier makes room for them)
            "queued_write_bytes": cache.tiers.queued_bytes() if cache is not None else 0,
            "max_live_bytes": max_live_bytes,
            "rss_bytes": rss_bytes(),
            "rss_at_start_bytes": self.base_rss,
            "pooled_free_bytes": pooled_free_bytes(),  # freed KV buffers kept for the next ones
            "heap_trims": self.heap.num_trims,  # freed pages handed back (idle, or RSS too high)
        }
