"""Request counters and the Prometheus text exposition (``promptcache_`` names)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from promptcache.core.figures import Series, render_series
from promptcache.server.records import RequestRecords

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.num += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        lines += [
            f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.num}',
            f"{name}_sum {self.total}",
            f"{name}_count {self.num}",
        ]
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def record(self, prompt: int, cached: int, completion: int, ttft_s: float | None) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.completion_tokens += completion
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self, cache: list[Series], records: RequestRecords | None = None) -> str:
        """The server's own counters, then the engine's figures as ``promptcache_<family>_*``."""
        with self._lock:
            lines = ["# TYPE promptcache_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(
                    f'promptcache_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}'
                )
            for name, value in (
                ("prompt_tokens_total", self.prompt_tokens),
                ("cached_prompt_tokens_total", self.cached_tokens),
                ("completion_tokens_total", self.completion_tokens),
            ):
                lines += [f"# TYPE promptcache_{name} counter", f"promptcache_{name} {value}"]
            lines += self.ttft.render("promptcache_ttft_seconds")
        lines += render_series(cache, "promptcache_")
        if records is not None:
            lines += render_records(records)
        return "\n".join(lines) + "\n"


def render_records(records: RequestRecords) -> list[str]:
    """Misses by reason and the windowed hit-rate alert."""
    alert = records.alert()
    lines = ["# TYPE promptcache_requests_by_miss_reason_total counter"]
    lines += [
        f'promptcache_requests_by_miss_reason_total{{reason="{k}"}} {v}'
        for k, v in records.reasons().items()
    ]
    rate = alert["window_hit_rate"]
    lines += [
        "# TYPE promptcache_hit_rate_window gauge",
        f"promptcache_hit_rate_window {rate if rate is not None else 'NaN'}",
        "# TYPE promptcache_hit_rate_alert_threshold gauge",
        f"promptcache_hit_rate_alert_threshold {alert['threshold']}",
        "# TYPE promptcache_hit_rate_alert gauge",
        f"promptcache_hit_rate_alert {int(alert['alerting'])}",
    ]
    return lines
