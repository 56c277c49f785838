"""SSD tier counters, with a reload latency histogram and throughput.

Updated from the writer thread, the reader pool and request threads: every update and every
snapshot goes through one lock, so no increment is lost and a snapshot is consistent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

# latency of one promotion's reads (all its blocks, read concurrently)
RELOAD_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class SsdStats:
    num_writes: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0  # queue full: never blocks a request
    write_errors: int = 0  # disk full, read-only, ...
    skipped_writes: int = 0  # dropped while backing off after a write error
    num_recoveries: int = 0  # writes that succeeded again after errors
    num_hits: int = 0  # lookups that promoted blocks from SSD
    num_misses: int = 0  # lookups that asked the SSD tier and found nothing longer
    promotion_failures: int = 0  # RAM budget could not be reserved
    num_promoted_blocks: int = 0
    num_read_races: int = 0  # blocks evicted between lookup and read: the hit ends there
    num_quarantined: int = 0
    num_evictions: int = 0
    num_expired: int = 0  # by retention or a block's TTL hint
    num_deleted: int = 0  # removed by a session or tenant deletion
    num_reindexed: int = 0
    num_rows_dropped: int = 0
    num_temp_removed: int = 0
    num_old_format_removed: int = 0  # files of an older block format (never served)
    reload_seconds: float = 0.0
    reload_bytes: int = 0
    reload_histogram: list[int] = field(default_factory=lambda: [0] * (len(RELOAD_BUCKETS_S) + 1))
    reconcile_s: float = 0.0
    last_error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """``add(num_hits=1, num_promoted_blocks=3)``: several counters, atomically."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def set(self, **values: Any) -> None:
        with self._lock:
            for name, v in values.items():
                setattr(self, name, v)

    def error(self, message: str, **counts: int) -> None:
        """Record ``message`` as the last error, with counters such as ``write_errors=1``."""
        with self._lock:
            self.last_error = message
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def get(self, name: str) -> Any:
        with self._lock:
            return getattr(self, name)

    def observe_reload(self, seconds: float, nbytes: int) -> None:
        i = next((k for k, b in enumerate(RELOAD_BUCKETS_S) if seconds <= b), len(RELOAD_BUCKETS_S))
        with self._lock:
            self.reload_seconds += seconds
            self.reload_bytes += nbytes
            self.reload_histogram[i] += 1

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
            out["reload_histogram"] = list(self.reload_histogram)
        out["reload_bytes_per_s"] = (
            out["reload_bytes"] / out["reload_seconds"] if out["reload_seconds"] else 0.0
        )
        out["reload_histogram"] = {
            f"le_{b}": c
            for b, c in zip((*RELOAD_BUCKETS_S, "inf"), out["reload_histogram"], strict=True)
        }
        return out
