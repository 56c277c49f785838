"""One cache record per request, the recent ones kept for ``/v1/cache/requests`` and the
dashboard, and the hit-rate alert over a window of recent requests."""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from promptcache.server.diagnosis import MISS_REASONS

log = logging.getLogger("promptcache.cache")
MIN_ALERT_REQUESTS = 5  # a window this full before the alert judges (one cold start is no incident)


@dataclass(slots=True)
class CacheRecord:
    request_id: int
    time_s: float  # wall clock at the first token (or the failure)
    tenant: str
    endpoint: str
    finish: str  # the finish reason ("stop", "length", "cancelled", ...)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_kind: str
    tokens_by_tier: dict[str, int]
    ttft_s: float | None
    saved_s: float  # estimated prefill time the reused tokens saved
    reason: str  # one of MISS_REASONS: why the computed part was not reused
    detail: dict[str, Any] = field(default_factory=dict)
    session: str = ""  # not shown; deleting the session removes its records
    phases: dict[str, float] = field(default_factory=dict)  # where the TTFT went (PhaseTimes)

    @property
    def ttft_uncached_s(self) -> float | None:
        return None if self.ttft_s is None else self.ttft_s + self.saved_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "time": self.time_s,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "finish": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "hit_kind": self.hit_kind,
            "tokens_by_tier": self.tokens_by_tier,
            "ttft_s": self.ttft_s,
            "ttft_uncached_s": self.ttft_uncached_s,
            "saved_s": self.saved_s,
            "reason": self.reason,
            "detail": self.detail,
            "phases": self.phases,
        }


class PrefillRate:
    """Seconds per computed prompt token: the median over the last requests that computed
    enough tokens to measure (a median: a warm-up or a queued request does not skew it)."""

    MIN_TOKENS = 32

    def __init__(self, window: int = 32) -> None:
        self._rates: deque[float] = deque(maxlen=window)
        self.s_per_token: float | None = None

    def observe(self, ttft_s: float | None, computed_tokens: int) -> None:
        if ttft_s is None or computed_tokens < self.MIN_TOKENS:
            return
        self._rates.append(ttft_s / computed_tokens)
        self.s_per_token = statistics.median(self._rates)

    def saved(self, cached_tokens: int) -> float:
        return cached_tokens * (self.s_per_token or 0.0)


class RequestRecords:
    """The last ``capacity`` records, per-reason counts and the windowed hit-rate alert.
    Thread-safe: records come from the generation threads."""

    name = "records"  # a SessionHolder (server/session_registry.py)

    def __init__(self, capacity: int = 1000, alert_below: float = 0.8, window: int = 50) -> None:
        if not 0 <= alert_below <= 1:
            raise ValueError(f"the hit-rate alert must be in [0, 1], got {alert_below}")
        if window < 1:
            raise ValueError(f"the hit-rate window must be at least 1 request, got {window}")
        self.alert_below = alert_below
        self.window = window
        self._records: deque[CacheRecord] = deque(maxlen=capacity)
        self._window: deque[tuple[int, int]] = deque(maxlen=window)  # (prompt, cached) tokens
        self._lock = threading.Lock()
        self._next_id = 0
        self.rate = PrefillRate()
        self.misses_by_reason = dict.fromkeys(MISS_REASONS, 0)
        self.is_alerting = False

    def next_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def add(self, record: CacheRecord) -> None:
        with self._lock:
            self._records.append(record)
            self.misses_by_reason[record.reason] = self.misses_by_reason.get(record.reason, 0) + 1
            if record.finish == "cancelled" and record.ttft_s is None:
                return  # left while queued: no prompt was looked at
            self._window.append((record.prompt_tokens, record.cached_tokens))
            rate, alerting = self._window_rate(), self.is_alerting
            self.is_alerting = rate is not None and rate < self.alert_below
        if self.is_alerting and not alerting:
            log.warning(
                "cache hit rate %.1f%% over the last %d requests is under the alert threshold "
                "of %.0f%%: see /v1/cache/requests (or /dashboard) for the miss reasons",
                100 * (rate or 0.0), len(self._window), 100 * self.alert_below,
            )  # fmt: skip
        elif alerting and not self.is_alerting:
            log.info("cache hit rate back to %.1f%% (threshold %.0f%%)", 100 * (rate or 0.0),
                     100 * self.alert_below)  # fmt: skip

    def _window_rate(self) -> float | None:
        if len(self._window) < min(self.window, MIN_ALERT_REQUESTS):
            return None
        prompt = sum(p for p, _ in self._window)
        return sum(c for _, c in self._window) / prompt if prompt else None

    def window_hit_rate(self) -> float | None:
        """Reused / prompt tokens over the window; None until it holds enough requests."""
        with self._lock:
            return self._window_rate()

    def forget(self, tenant: str, session: str | None = None, force: bool = False) -> int:
        """Remove the tenant's records of ``session`` (None: all); per-reason counts stay (they
        hold no content). Returns how many were removed (``force``: a record is one request's,
        never shared)."""
        with self._lock:
            kept = [
                r
                for r in self._records
                if not (r.tenant == tenant and (session is None or r.session == session))
            ]
            num_gone = len(self._records) - len(kept)
            self._records.clear()
            self._records.extend(kept)
            return num_gone

    def recent(self, limit: int, tenant: str | None = None) -> list[CacheRecord]:
        """Newest first; only ``tenant``'s when given."""
        with self._lock:
            items = list(self._records)
        out = []
        for rec in reversed(items):
            if tenant is None or rec.tenant == tenant:
                out.append(rec)
                if len(out) >= limit:
                    break
        return out

    def reasons(self, tenant: str | None = None) -> dict[str, int]:
        """Requests per miss reason: every request so far, or ``tenant``'s recent ones."""
        with self._lock:
            if tenant is None:
                return dict(self.misses_by_reason)
            out = dict.fromkeys(MISS_REASONS, 0)
            for r in self._records:
                if r.tenant == tenant:
                    out[r.reason] = out.get(r.reason, 0) + 1
            return out

    def alert(self, tenant: str | None = None) -> dict[str, Any]:
        """The alert state: server-wide, or over ``tenant``'s own last window of requests."""
        with self._lock:
            if tenant is None:
                rate, num = self._window_rate(), len(self._window)
            else:
                mine = [
                    (r.prompt_tokens, r.cached_tokens)
                    for r in reversed(self._records)
                    if r.tenant == tenant and not (r.finish == "cancelled" and r.ttft_s is None)
                ][: self.window]
                prompt = sum(p for p, _ in mine)
                enough = len(mine) >= min(self.window, MIN_ALERT_REQUESTS) and prompt
                rate = sum(c for _, c in mine) / prompt if enough else None
                num = len(mine)
        return {
            "threshold": self.alert_below,
            "window_requests": self.window,
            "requests_in_window": num,
            "window_hit_rate": rate,
            "alerting": rate is not None and rate < self.alert_below,
        }
