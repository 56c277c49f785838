"""Write health of the SSD tier: back off after a write error, then try again.

A full disk or a vanished folder must not cost every request a failing fsync, nor turn the
tier off for good: after an error, writes are skipped for a cool-down that doubles while the
errors go on (capped), and the first write after it tries the disk again.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class WriteHealth:
    def __init__(self, retry_s: float = 5.0, max_retry_s: float = 300.0) -> None:
        self.retry_s = retry_s
        self.max_retry_s = max(max_retry_s, retry_s)
        self._lock = threading.Lock()
        self._consecutive = 0
        self._retry_at = 0.0

    def may_write(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._retry_at

    def seconds_to_retry(self) -> float:
        with self._lock:
            return max(0.0, self._retry_at - time.monotonic())

    def failed(self) -> float:
        """Record an error; returns the cool-down before the next try."""
        with self._lock:
            self._consecutive += 1
            delay = min(self.retry_s * 2 ** min(self._consecutive - 1, 30), self.max_retry_s)
            self._retry_at = time.monotonic() + delay
            return delay

    def succeeded(self) -> bool:
        """Record a success; True when it ends a run of errors (a recovery)."""
        with self._lock:
            recovered = self._consecutive > 0
            self._consecutive, self._retry_at = 0, 0.0
            return recovered

    def describe(self) -> dict[str, Any]:
        with self._lock:
            wait = max(0.0, self._retry_at - time.monotonic())
            return {
                "write_state": "backing_off" if self._consecutive else "ok",
                "consecutive_write_errors": self._consecutive,
                "retry_in_s": round(wait, 3),
            }
