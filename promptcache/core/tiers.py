"""Building the tiers behind RAM from settings, so callers name tiers instead of classes."""

from __future__ import annotations

from pathlib import Path

from promptcache.core.budget import parse_size
from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.ssd_tier import DEFAULT_SSD_BUDGET, SsdTier
from promptcache.core.tier import LowerTier, make_tier


def make_lower_tiers(
    *,
    fingerprint: str,
    ssd_dir: str | Path | None = None,
    ssd_budget: int | str = DEFAULT_SSD_BUDGET,
    ssd_retention: float | None = None,
    codec: PayloadCodec | None = None,
    evictions: EvictionLog | None = None,
    cipher: BlockCipher | None = None,
) -> list[LowerTier]:
    """The lower tiers, nearest first, for ``PromptCache(next_tier=...)``: an SSD tier under
    ``ssd_dir`` when one is given (raises CacheDirLockedError when another process holds the
    model's folder); [] for a RAM-only cache."""
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
    return tiers


def _is_lower_tier(tier: SsdTier) -> LowerTier:
    return tier  # mypy checks here that SsdTier implements the protocol
