"""Sessions, deletion and expiry of the SSD tier (a mixin: ``SsdTier`` owns the state).

Tags and TTL hints live in the index (``sessions`` and ``ttls`` tables, rows only for indexed
blocks, dropped with their block). Deletion removes files and rows together under the files
lock, after the write queue is drained: a block queued before the deletion is written, then
removed, never left behind. ``remove_rows`` is shared with ``promptcache cache delete``, which
works on the folder without a running server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.stats import SsdStats


def remove_rows(root_dir: Path, index: SsdIndex, rows: list[Row]) -> int:
    """Delete the files and index rows (tags included); returns the file bytes freed. The
    caller holds the folder (its lock, and the tier's files lock when a tier is running)."""
    for r in rows:
        (root_dir / r.path).unlink(missing_ok=True)
    index.delete(r.block_hash for r in rows)
    return sum(r.file_bytes for r in rows)


class SsdSessions:
    root_dir: Path
    index: SsdIndex | None
    files_lock: threading.RLock
    stats: SsdStats
    clock: Callable[[], float]
    _pending: dict[BlockHash, bool]
    _pending_lock: threading.Lock
    # tags of blocks still queued for writing: applied right after their row is written
    _pending_tags: dict[BlockHash, list[BlockUse]]

    flush: Callable[[], bool]  # from SsdWrites

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        index = self.index
        if index is None or not hashes:
            return
        with self._pending_lock:
            for h in hashes:
                if h in self._pending:
                    self._pending_tags.setdefault(h, []).append(use)
        try:
            index.tag(hashes, use.session, use.ttl_s, now)
        except Exception as exc:  # a tag is bookkeeping: never fail a request over it
            self.stats.error(f"{type(exc).__name__}: {exc}")

    def _apply_pending_tags(self, block_hash: BlockHash, now: float) -> None:
        """After the block's row is written (the writer thread)."""
        with self._pending_lock:
            uses = self._pending_tags.pop(block_hash, [])
        index = self.index
        if index is not None:
            for use in uses:
                index.tag([block_hash], use.session, use.ttl_s, now)

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        self.flush()  # queued writes carry tags too
        index = self.index
        return index.session_blocks(session) if index is not None else {}

    def forget_session(self, session: str) -> None:
        if self.index is not None:
            self.index.forget_session(session)

    def _remove(self, rows_of: Callable[[SsdIndex], list[Row]]) -> tuple[int, int]:
        self.flush()
        index = self.index
        if index is None:
            return 0, 0
        with self.files_lock:
            rows = rows_of(index)
            freed = remove_rows(self.root_dir, index, rows)
        self.stats.add(num_deleted=len(rows))
        return len(rows), freed

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return self._remove(lambda index: index.subtree(hashes))

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        return self._remove(lambda index: index.rows_of_root(root))

    def expire(self, now: float) -> int:
        index = self.index
        if index is None:
            return 0
        with self.files_lock:
            rows = index.subtree(r.block_hash for r in index.expired(now))
            remove_rows(self.root_dir, index, rows)
        if rows:
            self.stats.add(num_expired=len(rows))
        return len(rows)
