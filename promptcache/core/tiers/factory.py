"""Building the tiers behind RAM from settings, so callers name tiers instead of classes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from promptcache.core.budget import parse_size
from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.tiers.base import LowerTier, make_tier
from promptcache.core.tiers.ssd.tier import DEFAULT_SSD_BUDGET, SsdTier

if TYPE_CHECKING:
    from promptcache.core.tiers.shared.store import ValkeyStore


def build_tiers(
    *,
    fingerprint: str,
    ssd_dir: str | Path | None = None,
    ssd_budget: int | str = DEFAULT_SSD_BUDGET,
    ssd_retention: float | None = None,
    codec: PayloadCodec | None = None,
    evictions: EvictionLog | None = None,
    shared_url: str | None = None,
    shared_ttl: float | None = None,
    cipher: BlockCipher | None = None,
) -> list[LowerTier]:
    """The lower tiers, nearest first, for ``PromptCache(next_tier=...)``: an SSD tier under
    ``ssd_dir`` when one is given (raises CacheDirLockedError when another process holds the
    model's folder), then the shared tier on the Valkey server at ``shared_url`` (entries
    living ``shared_ttl`` seconds; ValueError on a URL that is not a Valkey one; an unreachable
    server is not an error: the tier connects when it can); [] for a RAM-only cache."""
    tiers: list[LowerTier] = []
    if ssd_dir is not None:
        tiers.append(
            make_tier(
                "ssd",
                cache_dir=ssd_dir,
                model_fingerprint=fingerprint,
                codec=codec,
                budget_bytes=parse_size(ssd_budget),
                retention_s=ssd_retention,
                evictions=evictions,
                cipher=cipher,
            )
        )
    if shared_url:
        import promptcache.core.tiers.shared.store  # noqa: F401  (registers "shared"; needs valkey-py)

        kw: dict[str, Any] = {} if shared_ttl is None else {"ttl_s": float(shared_ttl)}
        if shared_ttl is not None and shared_ttl <= 0:
            raise ValueError(f"shared tier TTL must be positive, got {shared_ttl}")
        try:
            tiers.append(
                make_tier(
                    "shared",
                    url=shared_url,
                    model_fingerprint=fingerprint,
                    codec=codec,
                    evictions=evictions,
                    **kw,
                )
            )
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
    return tiers


def _is_lower_tier(tier: SsdTier, shared: ValkeyStore) -> tuple[LowerTier, LowerTier]:
    return tier, shared  # mypy checks here that both implement the protocol
