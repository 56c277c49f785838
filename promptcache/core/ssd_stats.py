"""SSD tier counters, with a reload latency histogram and throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# latency of one promotion's reads (all its blocks, read concurrently)
RELOAD_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class SsdStats:
    num_writes: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0  # queue full: never blocks a request
    write_errors: int = 0  # disk full, read-only, ...
    num_hits: int = 0  # lookups that promoted blocks from SSD
    num_misses: int = 0  # lookups that asked the SSD tier and found nothing longer
    promotion_failures: int = 0  # RAM budget could not be reserved
    num_promoted_blocks: int = 0
    num_quarantined: int = 0
    num_evictions: int = 0
    num_expired: int = 0
    num_reindexed: int = 0
    num_rows_dropped: int = 0
    num_temp_removed: int = 0
    reload_seconds: float = 0.0
    reload_bytes: int = 0
    reload_histogram: list[int] = field(default_factory=lambda: [0] * (len(RELOAD_BUCKETS_S) + 1))
    reconcile_s: float = 0.0
    last_error: str = ""

    def observe_reload(self, seconds: float, nbytes: int) -> None:
        self.reload_seconds += seconds
        self.reload_bytes += nbytes
        i = next((k for k, b in enumerate(RELOAD_BUCKETS_S) if seconds <= b), len(RELOAD_BUCKETS_S))
        self.reload_histogram[i] += 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reload_bytes_per_s"] = (
            self.reload_bytes / self.reload_seconds if self.reload_seconds else 0.0
        )
        out["reload_histogram"] = {
            f"le_{b}": c
            for b, c in zip((*RELOAD_BUCKETS_S, "inf"), self.reload_histogram, strict=True)
        }
        return out
