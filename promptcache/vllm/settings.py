"""The connector's settings (``kv_connector_extra_config``) and what a request tells it.

A request's tenant is vLLM's own ``cache_salt`` (the root of its hash chain: two salts never
share a block); its session and TTL hint come in ``vllm_xargs`` (``promptcache_session``,
``promptcache_ttl``), which vLLM hands to the connector as ``sampling_params.extra_args``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from promptcache.core.budget import parse_size
from promptcache.core.sessions import TTL_HINTS

SESSION_ARG = "promptcache_session"
TTL_ARG = "promptcache_ttl"
_KEYS = {"cache_dir", "shared_tier", "ram_budget", "ssd_budget", "shared_ttl"}


@dataclass(slots=True, frozen=True)
class ConnectorSettings:
    cache_dir: str | None = None  # the SSD tier's folder (None: no SSD tier)
    shared_tier: str | None = None  # valkey://host:port/db (None: no shared tier)
    ram_budget: int = 2 * 10**9  # bytes of KV the worker keeps in RAM
    ssd_budget: int = 64 * 10**9
    shared_ttl: float | None = None  # seconds a shared entry lives (None: the tier's default)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config``; ValueError names an unknown key or a
        bad size, so a typo fails vLLM's start-up instead of silently caching nothing."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(
                f"promptcache connector: unknown kv_connector_extra_config keys {unknown}; "
                f"known: {sorted(_KEYS)}"
            )
        ttl = extra.get("shared_ttl")
        return cls(
            cache_dir=str(extra["cache_dir"]) if extra.get("cache_dir") else None,
            shared_tier=str(extra["shared_tier"]) if extra.get("shared_tier") else None,
            ram_budget=parse_size(extra.get("ram_budget", "2GB")),
            ssd_budget=parse_size(extra.get("ssd_budget", "64GB")),
            shared_ttl=float(ttl) if ttl is not None else None,
        )


@dataclass(slots=True, frozen=True)
class RequestTags:
    """Who a request's blocks belong to: the tenant (hashed into the chain) and the session
    and TTL hint (recorded on the blocks, never hashed)."""

    tenant: str = ""
    session: str = ""
    ttl_s: float | None = None


def request_tags(cache_salt: str | None, extra_args: dict[str, Any] | None) -> RequestTags:
    """A request's tags from its ``cache_salt`` and ``vllm_xargs``; a bad TTL hint is ignored
    (the request was already accepted by vLLM: a cache hint never fails it)."""
    args = extra_args or {}
    session = str(args.get(SESSION_ARG) or "")
    ttl: float | None = None
    if args.get(TTL_ARG) is not None:
        ttl = _ttl_seconds(str(args[TTL_ARG]))
    return RequestTags(cache_salt or "", session, ttl)


def _ttl_seconds(value: str) -> float | None:
    """``5m``/``1h`` (the hints our server takes) or plain seconds; None when neither."""
    if value in TTL_HINTS:
        return TTL_HINTS[value]
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds > 0 else None
