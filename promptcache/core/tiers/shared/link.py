"""The shared tier's connection to Valkey: one client, its health, its counters.

Client: ``valkey`` (valkey-py), chosen over ``valkey-glide`` and ``redis``: it is the Valkey
project's own fork of redis-py, released with the server, synchronous (the tier runs on request
threads and one writer thread, no event loop), speaks to Redis servers too, has cluster mode and
Lua scripts (NOSCRIPT after a restart reloads the script), and with ``libvalkey`` installed
parses replies in C (benchmarks/valkey_bench.py measures the store against raw GET/SET).
Measured here (loopback, a busy 2-core machine, best of 3): GET of 1.5-2.9 MB values 650-1650 MB/s
with valkey-py vs 800-2000 MB/s with ``valkey-glide-sync`` 2.6 (a Rust core behind FFI), 92 KB
values 2250 vs 1200-1550 MB/s: on par for reads, the request path. Glide SETs large values 2-4x
faster (850-1850 vs 400-630 MB/s), but writes run on the background writer, where encoding the
block (checksum, safetensors) costs more than the SET. Glide's sync client is young and a 7 MB
native wheel; valkey-py is pure Python plus ``libvalkey``. ``redis`` would work unchanged but
tracks Redis, not Valkey.

Faults never reach a request: a connection error or a timeout marks the link ``down`` and every
call returns None at once (no connect timeout per request) until the back-off has passed and a
probe (``probe``, from the tier's background thread) gets a PONG; the back-off doubles while
probes fail, capped. An out-of-memory reply (maxmemory reached under ``noeviction``) is counted
and the write dropped; the link stays up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import valkey
from valkey import exceptions as vex

from promptcache.core.figures import Series, counter, histogram
from promptcache.core.tiers.counters import TierCounters, bucket_table
from promptcache.core.tiers.write_behind import Backoff

log = logging.getLogger("promptcache.shared")
T = TypeVar("T")

# round trips (one command, pipeline or script call)
RTT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_DOWN_ERRORS = (vex.ConnectionError, vex.TimeoutError, vex.ClusterDownError, vex.ClusterError,
                vex.SlotNotCoveredError, vex.BusyLoadingError, OSError)  # fmt: skip


@dataclass(slots=True)
class SharedStats(TierCounters):
    num_lookups: int = counter(0)  # lookups asked of this tier (none while down)
    num_found: int = counter(0)  # lookups that found blocks
    num_hits: int = counter(0)  # lookups that promoted blocks from this tier
    num_misses: int = counter(0)  # lookups that asked this tier and promoted nothing from it
    promotion_failures: int = counter(0)  # RAM budget could not be reserved for its blocks
    num_promoted_blocks: int = counter(0)
    num_blocks_read: int = counter(0)
    bytes_read: int = counter(0)
    read_seconds: float = counter(0.0)  # the read round trips, values verified
    num_writes: int = counter(0)
    bytes_written: int = counter(0)
    dropped_writes: int = counter(0)  # queue full, or the link down: never blocks a request
    skipped_writes: int = counter(0)  # already stored
    dropped_touches: int = counter(0)  # touches and session tags dropped on a full queue
    oom_errors: int = counter(0)  # the server refused a write (maxmemory under noeviction)
    errors: int = counter(0)  # connection errors, timeouts, other error replies
    num_corrupt: int = counter(0)  # entries whose data failed verification: deleted, never served
    num_missing: int = counter(0)  # entries whose data had expired or been evicted: index cleaned
    num_read_races: int = counter(0)  # values rewritten between lookup and read: the hit ends there
    num_swept: int = counter(0)  # stale index entries removed by puts
    num_warmed_blocks: int = counter(0)  # pulled into RAM by the start-up warm-up
    warmed_bytes: int = counter(0)
    num_disconnects: int = counter(0)
    num_reconnects: int = counter(0)
    rtt_seconds: float = 0.0
    rtt_histogram: list[int] = field(default_factory=lambda: [0] * (len(RTT_BUCKETS_S) + 1))

    def observe_rtt(self, seconds: float) -> None:
        self.observe("rtt_histogram", RTT_BUCKETS_S, seconds, rtt_seconds=seconds)

    def observe_read(self, seconds: float, nbytes: int) -> None:
        self.add(read_seconds=seconds, bytes_read=nbytes)

    def to_dict(self) -> dict[str, Any]:
        return self._json(self.snapshot())

    def figures(self) -> tuple[dict[str, Any], list[Series]]:
        """``to_dict()`` and its series, from one snapshot."""
        values = self.snapshot()
        hist = histogram(
            "rtt_seconds", RTT_BUCKETS_S, values["rtt_histogram"], values["rtt_seconds"]
        )
        return self._json(values), [*self.series(values), hist]

    def _json(self, out: dict[str, Any]) -> dict[str, Any]:
        out = dict(out)
        hist = out["rtt_histogram"]
        out["rtt_histogram"] = bucket_table(RTT_BUCKETS_S, hist)
        n = sum(hist)
        out["rtt_mean_s"] = out["rtt_seconds"] / n if n else 0.0
        out["read_bytes_per_s"] = (
            out["bytes_read"] / out["read_seconds"] if out["read_seconds"] else 0.0
        )
        return out


def is_cluster_url(url: str) -> bool:
    parts = urlsplit(url)
    return "+cluster" in parts.scheme or parse_qs(parts.query).get("cluster") == ["1"]


def make_client(url: str, timeout_s: float) -> Any:
    """A client for ``valkey://host:port/db`` (also ``redis://``, ``valkeys://``, ``rediss://``);
    ``?cluster=1`` (or a ``+cluster`` scheme such as ``valkey+cluster://``) for cluster mode."""
    parts = urlsplit(url)
    scheme = parts.scheme.replace("+cluster", "")
    cluster = is_cluster_url(url)
    if scheme not in ("valkey", "valkeys", "redis", "rediss", "unix"):
        raise ValueError(f"not a Valkey URL: {url!r} (valkey://host:port/db)")
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("cluster="))
    plain = parts._replace(scheme=scheme, query=query).geturl()
    opts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if cluster:
        from valkey.cluster import ValkeyCluster

        # one try per call: the link's own back-off decides when to try again
        return ValkeyCluster.from_url(
            plain, cluster_error_retry_attempts=1, require_full_coverage=False, **opts
        )
    return valkey.Valkey.from_url(plain, **opts)


class ValkeyLink:
    """A client that is either up or down, with back-off; ``call`` never raises."""

    def __init__(
        self, url: str, *, timeout_s: float = 0.5, retry_s: float = 0.25, max_retry_s: float = 30.0
    ) -> None:
        self.url = url
        self.cluster = is_cluster_url(url)
        self.timeout_s = timeout_s
        self.backoff = Backoff(retry_s, max_retry_s)  # between probes while down
        self.stats = SharedStats()
        self._lock = threading.Lock()
        self._client: Any = None  # built lazily: a cluster client connects in its constructor
        self._up = False

    @property
    def is_up(self) -> bool:
        return self._up

    def describe(self) -> str:
        """The link's state in words (errors, logs)."""
        if self._up:
            return "connected"
        return f"down (retry in {self.backoff.seconds_to_retry():.2f} s)"

    def _down(self, exc: BaseException) -> None:
        with self._lock:
            was_up = self._up
            self._up = False
            delay = self.backoff.failed()
        self.stats.error(f"{type(exc).__name__}: {exc}", errors=1, num_disconnects=int(was_up))
        if was_up:
            log.warning(
                "shared tier down (%s: %s); retrying in %.2f s", type(exc).__name__, exc, delay
            )

    def probe_due(self) -> bool:
        return not self._up and self.backoff.is_ready()

    def probe(self) -> bool:
        """PING when down and the back-off has passed; True when the link is (now) up."""
        if self._up:
            return True
        if not self.probe_due():
            return False
        try:
            if self._client is None:
                self._client = make_client(self.url, self.timeout_s)
            t0 = time.perf_counter()
            self._client.ping()
            self.stats.observe_rtt(time.perf_counter() - t0)
        except ValueError:
            raise
        except Exception as exc:
            self._down(exc)
            return False
        with self._lock:
            recovered = self.backoff.succeeded()
            self._up = True
        if recovered:
            self.stats.add(num_reconnects=1)
            log.warning("shared tier connected again: %s", self.url)
        return True

    def call(self, fn: Callable[[Any], T]) -> T | None:
        """``fn(client)``, timed; None when down or on any error (counted, logged once)."""
        if not self._up:
            return None
        client = self._client
        t0 = time.perf_counter()
        try:
            out = fn(client)
        except vex.OutOfMemoryError as exc:
            self.stats.error(f"OutOfMemoryError: {exc}", oom_errors=1)
            return None
        except _DOWN_ERRORS as exc:
            self._down(exc)
            return None
        except Exception as exc:  # an error reply, a bad script...: this call fails, link stays
            self.stats.error(f"{type(exc).__name__}: {exc}", errors=1)
            log.debug("shared tier call failed", exc_info=True)
            return None
        self.stats.observe_rtt(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        client, self._client, self._up = self._client, None, False
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
