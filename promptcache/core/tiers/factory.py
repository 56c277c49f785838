"""Building the tiers behind RAM from settings: every registered tier (``registry``) asked in
order, so callers name options instead of classes, and a new tier needs no change here."""

from __future__ import annotations

from typing import Any

from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.options import TierContext
from promptcache.core.tiers.registry import tier_entries


def build_tiers(
    *,
    fingerprint: str,
    codec: PayloadCodec | None = None,
    evictions: EvictionLog | None = None,
    cipher: BlockCipher | None = None,
    **options: Any,
) -> list[BlockStore]:
    """The lower tiers, nearest first, for ``PromptCache(next_tier=...)``: each registered tier
    whose ``options`` ask for it (``ssd_dir=``: the SSD tier, ``shared_url=``: the shared tier;
    an option left out takes its tier's default); [] for a RAM-only cache. TypeError on an
    option no tier reads; a tier's own errors (ValueError on a bad setting,
    CacheDirLockedError) close what was built before it and propagate."""
    entries = tier_entries()
    unknown = set(options) - {o for e in entries for o in e.options}
    if unknown:
        raise TypeError(f"build_tiers: no tier reads {', '.join(sorted(unknown))}")
    ctx = TierContext(fingerprint, codec, evictions, cipher)
    tiers: list[BlockStore] = []
    try:
        for entry in entries:
            mine = {k: options.get(k, default) for k, default in entry.options.items()}
            tier = entry.build(mine, ctx)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
