"""Sessions, deletion and expiry of the SSD tier (``SsdSessions``, a part of ``SsdTier``).

Tags and TTL hints live in the index (``sessions`` and ``ttls`` tables, rows only for indexed
blocks, dropped with their block). Deletion removes files and rows together under the files
lock, after the write queue is drained: a block queued before the deletion is written, then
removed, never left behind. ``remove_rows`` is shared with ``promptcache cache delete``, which
works on the folder without a running server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.ssd.index import Row, SsdIndex

if TYPE_CHECKING:
    from promptcache.core.tiers.ssd.folder import SsdFolder
    from promptcache.core.tiers.ssd.write import SsdWriter


def remove_rows(root_dir: Path, index: SsdIndex, rows: list[Row]) -> int:
    """Delete the files and index rows (tags included); returns the file bytes freed. The
    caller holds the folder (its lock, and the tier's files lock when a tier is running)."""
    for r in rows:
        (root_dir / r.path).unlink(missing_ok=True)
    index.delete(r.block_hash for r in rows)
    return sum(r.file_bytes for r in rows)


def expire_rows(folder: SsdFolder, index: SsdIndex, now: float) -> int:
    """Remove the blocks whose TTL hint ran out by ``now``, with their descendants (caller may
    hold the files lock; it is taken here too). Returns the number removed."""
    with folder.files_lock:
        rows = index.subtree(r.block_hash for r in index.expired(now))
        remove_rows(folder.root_dir, index, rows)
    if rows:
        folder.stats.add(num_expired=len(rows))
    return len(rows)


class SsdSessions:
    """The SSD tier's ``SessionAdmin`` half (and ``delete_blocks``), over its folder and its writer (deletions
    wait for the writer's queue; tags of queued blocks wait in the writer)."""

    def __init__(self, folder: SsdFolder, writer: SsdWriter) -> None:
        self.folder = folder
        self.writer = writer

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        index = self.folder.index
        if index is None or not hashes:
            return
        self.writer.note_tags(hashes, use)
        try:
            index.tag(hashes, use.session, use.ttl_s, now)
        except Exception as exc:  # a tag is bookkeeping: never fail a request over it
            self.folder.stats.error(f"{type(exc).__name__}: {exc}")

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        self.writer.flush()  # queued writes carry tags too
        index = self.folder.index
        return index.session_blocks(session) if index is not None else {}

    def forget_session(self, session: str) -> None:
        index = self.folder.index
        if index is not None:
            index.forget_session(session)

    def _remove(self, rows_of: Callable[[SsdIndex], list[Row]]) -> tuple[int, int]:
        self.writer.flush()
        f = self.folder
        index = f.index
        if index is None:
            return 0, 0
        with f.files_lock:
            rows = rows_of(index)
            freed = remove_rows(f.root_dir, index, rows)
        f.stats.add(num_deleted=len(rows))
        return len(rows), freed

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return self._remove(lambda index: index.subtree(hashes))

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        return self._remove(lambda index: index.rows_of_root(root))

    def expire(self, now: float) -> int:
        index = self.folder.index
        return expire_rows(self.folder, index, now) if index is not None else 0
