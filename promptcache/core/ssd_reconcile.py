"""Start-up recovery of the SSD tier: make the index and the files agree after any crash.

Rows without files are dropped; valid files without rows are indexed again (header, identity
and checksum verified); temp files left by an interrupted write are removed; anything that
fails a check is quarantined, never served.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from promptcache.core.block_file import SUFFIX, TMP_PREFIX, CorruptBlockError, check_block
from promptcache.core.ssd_index import Row

if TYPE_CHECKING:
    from promptcache.core.ssd_tier import SsdTier


def reconcile_dir(tier: SsdTier) -> None:
    """Drop rows without files, index valid files without rows, remove temp files, and
    quarantine files whose header, identity or checksum fails."""
    t0 = time.perf_counter()
    rows = {r.path: r for r in tier.index.all_rows()}
    on_disk: set[str] = set()
    for path in tier.root_dir.rglob("*"):
        if (
            not path.is_file()
            or tier.quarantine_dir in path.parents
            or path.parent == tier.root_dir
        ):
            continue
        if path.name.startswith(TMP_PREFIX):
            path.unlink(missing_ok=True)
            tier.stats.num_temp_removed += 1
            continue
        if path.suffix != SUFFIX:
            continue
        rel = str(path.relative_to(tier.root_dir))
        on_disk.add(rel)
        if rel not in rows:
            _reindex(tier, path, rel)
    missing = [r for p, r in rows.items() if p not in on_disk]
    if missing:
        tier.index.delete(r.block_hash for r in missing)
        tier.stats.num_rows_dropped += len(missing)
    tier.stats.reconcile_s = time.perf_counter() - t0


def _reindex(tier: SsdTier, path: Path, rel: str) -> None:
    try:
        data = path.read_bytes()
        info = check_block(data)
        if info.model != tier.model:
            raise CorruptBlockError("file belongs to another model")
        if path.stem != info.block_hash.hex():
            raise CorruptBlockError("file name does not match its block hash")
    except (OSError, CorruptBlockError) as exc:
        tier.quarantine(path, None, str(exc))
        return
    now = time.time()
    tier.index.upsert(
        Row(
            info.block_hash,
            info.parent_hash,
            info.root,
            info.token_bytes,
            info.extra,
            int.from_bytes(info.token_bytes[:4], "little"),
            info.depth,
            rel,
            len(data),
            info.payload_nbytes,
            info.has_checkpoint,
            info.is_seq_end,
            now,
            now,
        )  # fmt: skip
    )
    tier.stats.num_reindexed += 1
