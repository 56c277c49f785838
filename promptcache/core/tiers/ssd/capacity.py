"""Capacity of the SSD tier: retention first, then least recently used leaves until the byte
budget holds. Files and rows go together under the tier's files lock, so a reader either opens a
file before it is deleted (and reads it whole) or sees its row gone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from promptcache.core.tiers.ssd.index import Row, SsdIndex

if TYPE_CHECKING:
    from promptcache.core.tiers.ssd.tier import SsdTier


def enforce_capacity(tier: SsdTier, index: SsdIndex) -> None:
    """Caller holds ``tier.files_lock``."""
    tier.expire(tier.clock())  # per-block TTL hints first
    if tier.retention_s is not None:
        cutoff = tier.clock() - tier.retention_s
        while True:
            old = [r for r in index.lru_leaves(256) if r.last_access < cutoff]
            if not old:
                break
            delete_blocks(tier, index, old)
            tier.stats.add(num_expired=len(old))
    _, used = index.totals()
    while used > tier.budget_bytes:
        leaves = index.lru_leaves(64)
        if not leaves:
            break
        for r in leaves:
            if used <= tier.budget_bytes:
                break
            delete_blocks(tier, index, [r])
            tier.stats.add(num_evictions=1)
            used -= r.file_bytes


def delete_blocks(tier: SsdTier, index: SsdIndex, rows: list[Row]) -> None:
    """Files, rows, and the record of a namespace left without a block (caller holds the lock)."""
    for r in rows:
        (tier.root_dir / r.path).unlink(missing_ok=True)
        if tier.evictions is not None:
            tier.evictions.note(r.block_hash, r.meta.parent_hash, tier.name)
    index.delete(r.block_hash for r in rows)
