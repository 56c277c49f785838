"""Writes of the SSD tier: a bounded write-behind queue (``write_behind``) and its writer.

A request never waits: when the queue is full the block is dropped and counted. The temp file
is written and fsynced outside the files lock (readers go on); the rename and the index row go
together under it. After a write error the writer backs off (``folder.health``) and tries
again, and while the tier is off it retries opening its folder. Tags of a block still queued
are kept here and applied right after its row is written.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time

from promptcache.core.block_file import commit_temp, encode_block_parts, seal_file, write_temp
from promptcache.core.hashing import BlockHash
from promptcache.core.safetensors_io import num_bytes
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.base import BlockRecord
from promptcache.core.tiers.ssd.folder import SsdFolder
from promptcache.core.tiers.ssd.index import Row
from promptcache.core.tiers.ssd.lock import CacheDirLockedError
from promptcache.core.tiers.write_behind import WriteBehind

log = logging.getLogger("promptcache.ssd")


class SsdWriter:
    """Invariant: a hash is in ``_pending`` while a record of it is queued or being written
    (True: one of them carries a checkpoint); ``_pending_tags`` only holds pending hashes."""

    def __init__(self, folder: SsdFolder, queue_blocks: int) -> None:
        self.folder = folder
        self._pending: dict[BlockHash, bool] = {}
        self._pending_tags: dict[BlockHash, list[BlockUse]] = {}
        self._pending_lock = threading.Lock()
        self._last_enforce = 0.0
        self.queue: WriteBehind[BlockRecord] = WriteBehind(
            "promptcache-ssd-writer",
            self._handle,
            max_items=queue_blocks,
            on_error=self._failed,
            on_drop=lambda _: folder.stats.add(dropped_writes=1),
            idle=self._idle,
            yields_cpu=True,
            size=lambda record: record.nbytes,
        )

    def put(self, record: BlockRecord) -> bool:
        f = self.folder
        index = f.index
        if f.is_closed or index is None:
            return False
        if not f.health.is_ready():  # backing off after a write error
            f.stats.add(skipped_writes=1)
            return False
        has_checkpoint = record.checkpoint is not None
        with self._pending_lock:
            queued = self._pending.get(record.block_hash)
            if queued is not None and (queued or not has_checkpoint):
                return True
        row = index.get(record.block_hash)
        if row is not None and (row.has_checkpoint or record.checkpoint is None):
            if record.sessions or record.ttl_s is not None:  # a spill: its RAM tags join
                for session in record.sessions or ("",):
                    index.tag([record.block_hash], session, record.ttl_s, row.last_access)
            return True
        with self._pending_lock:
            if not self.queue.offer(record):
                return False
            self._pending[record.block_hash] = has_checkpoint or bool(queued)
        return True

    def note_tags(self, hashes: list[BlockHash], use: BlockUse) -> None:
        """Keep ``use`` for the hashes still queued: their rows do not exist yet."""
        with self._pending_lock:
            for h in hashes:
                if h in self._pending:
                    self._pending_tags.setdefault(h, []).append(use)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk; False on timeout."""
        return self.queue.flush(timeout, poll_s=0.005)

    def close(self) -> None:
        self.queue.close(timeout=30)

    # -- the writer thread -------------------------------------------------------------------

    def _idle(self) -> float | None:
        """While off, retry opening the folder (when the cool-down allows) and wake up to try
        again; otherwise wait for work."""
        f = self.folder
        if f.index is None and not f.is_closed and f.health.is_ready():
            try:
                opened = f.open()
            except CacheDirLockedError as exc:
                opened = f.open_failed(exc)
            if opened:
                f.health.succeeded()
                f.stats.add(num_recoveries=1)
                log.warning("SSD tier on again in %s", f.root_dir)
        return max(0.05, f.health.seconds_to_retry()) if f.index is None else None

    def _handle(self, record: BlockRecord) -> None:
        f = self.folder
        try:
            if not f.health.is_ready():
                f.stats.add(skipped_writes=1)
                return
            self._write(record)
            if f.health.succeeded():
                f.stats.add(num_recoveries=1)
                log.warning("SSD writes work again (after %s)", f.stats.get("last_error"))
            # the budget holds again before the write counts as done (flush() waits for it)
            if time.monotonic() - self._last_enforce > 1.0 or self.queue.num_queued == 0:
                f.enforce_capacity()
                self._last_enforce = time.monotonic()
        finally:
            with self._pending_lock:
                if self._pending.get(record.block_hash) == (record.checkpoint is not None):
                    del self._pending[record.block_hash]
                    self._pending_tags.pop(record.block_hash, None)

    def _failed(self, record: BlockRecord, exc: Exception) -> None:
        """Disk full, read-only, ...: keep serving from RAM, back off, say so once."""
        f = self.folder
        delay = f.health.failed()
        f.stats.error(f"{type(exc).__name__}: {exc}", write_errors=1)
        log.warning(
            "SSD write failed (%d so far): %s; writes skipped for %.1f s",
            f.stats.get("write_errors"),
            exc,
            delay,
        )

    def _apply_pending_tags(self, block_hash: BlockHash, now: float) -> None:
        """After the block's row is written (the writer thread)."""
        with self._pending_lock:
            uses = self._pending_tags.pop(block_hash, [])
        index = self.folder.index
        if index is not None:
            for use in uses:
                index.tag([block_hash], use.session, use.ttl_s, now)

    def _write(self, record: BlockRecord) -> None:
        f = self.folder
        index = f.index
        assert index is not None
        meta = record.meta
        path = f.path_for(meta.root, meta.block_hash)
        parts = encode_block_parts(record, f.model, f.codec)  # views of the payload's arrays
        if f.cipher is not None:
            parts = [seal_file(b"".join(parts), f.cipher, path.stem)]
        tmp = write_temp(path, parts)  # the slow part (fsync) outside the lock: reads go on
        num_file_bytes = num_bytes(parts)
        with f.files_lock:
            commit_temp(tmp, path)
            now = f.clock()
            old = index.get(meta.block_hash)
            row = Row(
                meta,
                str(path.relative_to(f.root_dir)),
                num_file_bytes,
                record.nbytes,
                record.checkpoint is not None,
                record.is_seq_end,
                old.created if old else now,
                now,
            )
            try:
                index.upsert(row, f.tenant(meta.root), record.sessions, record.ttl_s)
                self._apply_pending_tags(meta.block_hash, now)
            except BaseException:  # no file without its row: it would hold bytes off the budget
                path.unlink(missing_ok=True)
                with contextlib.suppress(sqlite3.Error):
                    index.delete([meta.block_hash])
                raise
        f.stats.add(num_writes=1, bytes_written=num_file_bytes)
