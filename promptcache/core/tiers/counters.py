"""Tier counters under one lock: updated from writer threads, reader pools and request threads,
so no increment is lost and a snapshot is consistent. A tier's stats are a slots dataclass of
counters deriving from ``TierCounters`` (each declared ``counter``/``gauge``, ``core.figures``);
latency histograms share ``bucket_of``/``bucket_table``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from promptcache.core.figures import Series, field_series

__all__ = ["TierCounters", "bucket_of", "bucket_table"]


@dataclass(slots=True)
class TierCounters:
    last_error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """``add(num_hits=1, num_promoted_blocks=3)``: several counters, atomically."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def set(self, **values: Any) -> None:
        with self._lock:
            for name, v in values.items():
                setattr(self, name, v)

    def get(self, name: str) -> Any:
        with self._lock:
            return getattr(self, name)

    def error(self, message: str, **counts: int) -> None:
        """Record ``message`` as the last error, with counters such as ``write_errors=1``."""
        with self._lock:
            self.last_error = message[:300]
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def observe(
        self, histogram_name: str, buckets: tuple[float, ...], seconds: float, **sums: float
    ) -> None:
        """One latency into the named histogram, and ``sums`` added, atomically."""
        i = bucket_of(buckets, seconds)
        with self._lock:
            getattr(self, histogram_name)[i] += 1
            for name, n in sums.items():
                setattr(self, name, getattr(self, name) + n)

    def series(self, values: dict[str, Any]) -> list[Series]:
        """The declared counters of a ``snapshot()`` (a subclass adds its histograms)."""
        return field_series(type(self), values)

    def snapshot(self) -> dict[str, Any]:
        """Every counter (histograms copied), taken under the lock."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
            return {k: list(v) if isinstance(v, list) else v for k, v in out.items()}


def bucket_of(buckets: tuple[float, ...], seconds: float) -> int:
    """The histogram bucket of ``seconds``: the first upper bound it does not pass."""
    return next((k for k, b in enumerate(buckets) if seconds <= b), len(buckets))


def bucket_table(buckets: tuple[float, ...], counts: list[int]) -> dict[str, int]:
    """``{"le_0.001": n, ..., "le_inf": n}`` for ``/v1/cache/stats`` and the metrics."""
    return {f"le_{b}": c for b, c in zip((*buckets, "inf"), counts, strict=True)}
