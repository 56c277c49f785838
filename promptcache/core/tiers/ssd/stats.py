"""SSD tier counters (``counters.TierCounters``), with a reload latency histogram and throughput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from promptcache.core.figures import Series, counter, gauge, histogram
from promptcache.core.tiers.counters import TierCounters, bucket_table

# latency of one promotion's reads (all its blocks, read concurrently)
RELOAD_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class SsdStats(TierCounters):
    num_writes: int = counter(0)
    bytes_written: int = counter(0)
    dropped_writes: int = counter(0)  # queue full: never blocks a request
    write_errors: int = counter(0)  # disk full, read-only, ...
    skipped_writes: int = counter(0)  # dropped while backing off after a write error
    num_recoveries: int = counter(0)  # writes that succeeded again after errors
    num_hits: int = counter(0)  # lookups that promoted blocks from SSD
    num_misses: int = counter(0)  # lookups that asked the SSD tier and found nothing longer
    promotion_failures: int = counter(0)  # RAM budget could not be reserved
    num_promoted_blocks: int = counter(0)
    num_read_races: int = counter(0)  # blocks evicted between lookup and read: the hit ends there
    num_quarantined: int = counter(0)
    num_evictions: int = counter(0)
    num_expired: int = counter(0)  # by retention or a block's TTL hint
    num_deleted: int = counter(0)  # removed by a session or tenant deletion
    num_reindexed: int = counter(0)
    num_rows_dropped: int = counter(0)
    num_temp_removed: int = counter(0)
    num_old_format_removed: int = counter(0)  # files of an older block format (never served)
    reload_seconds: float = 0.0
    reload_bytes: int = counter(0)
    reload_histogram: list[int] = field(default_factory=lambda: [0] * (len(RELOAD_BUCKETS_S) + 1))
    reconcile_s: float = gauge(0.0)

    def observe_reload(self, seconds: float, nbytes: int) -> None:
        self.observe(
            "reload_histogram",
            RELOAD_BUCKETS_S,
            seconds,
            reload_seconds=seconds,
            reload_bytes=nbytes,
        )

    def to_dict(self) -> dict[str, Any]:
        return self._json(self.snapshot())

    def _json(self, out: dict[str, Any]) -> dict[str, Any]:
        out = dict(out)
        out["reload_bytes_per_s"] = (
            out["reload_bytes"] / out["reload_seconds"] if out["reload_seconds"] else 0.0
        )
        out["reload_histogram"] = bucket_table(RELOAD_BUCKETS_S, out["reload_histogram"])
        return out

    def figures(self) -> tuple[dict[str, Any], list[Series]]:
        """``to_dict()`` and its series, from one snapshot."""
        values = self.snapshot()
        hist = histogram(
            "reload_seconds", RELOAD_BUCKETS_S, values["reload_histogram"], values["reload_seconds"]
        )
        return self._json(values), [*self.series(values), hist]
