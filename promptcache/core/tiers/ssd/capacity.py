"""Capacity of the SSD tier: retention first, then least recently used leaves until the byte
budget holds. Files and rows go together under the tier's files lock, so a reader either opens a
file before it is deleted (and reads it whole) or sees its row gone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.sessions import expire_rows

if TYPE_CHECKING:
    from promptcache.core.tiers.ssd.folder import SsdFolder


def enforce_capacity(folder: SsdFolder, index: SsdIndex) -> None:
    """Caller holds ``folder.files_lock``."""
    expire_rows(folder, index, folder.clock())  # per-block TTL hints first
    if folder.retention_s is not None:
        cutoff = folder.clock() - folder.retention_s
        while True:
            old = [r for r in index.lru_leaves(256) if r.last_access < cutoff]
            if not old:
                break
            delete_blocks(folder, index, old)
            folder.stats.add(num_expired=len(old))
    _, used = index.totals()
    while used > folder.budget_bytes:
        leaves = index.lru_leaves(64)
        if not leaves:
            break
        for r in leaves:
            if used <= folder.budget_bytes:
                break
            delete_blocks(folder, index, [r])
            folder.stats.add(num_evictions=1)
            used -= r.file_bytes


def delete_blocks(folder: SsdFolder, index: SsdIndex, rows: list[Row]) -> None:
    """Files, rows, and the record of a namespace left without a block (caller holds the lock)."""
    for r in rows:
        (folder.root_dir / r.path).unlink(missing_ok=True)
        if folder.evictions is not None:
            folder.evictions.note(r.block_hash, r.meta.parent_hash, folder.name)
    index.delete(r.block_hash for r in rows)
