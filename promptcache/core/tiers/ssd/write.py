"""Writes of the SSD tier: a bounded queue drained by one writer thread.

A request never waits: when the queue is full the block is dropped and counted. The temp file
is written and fsynced outside the files lock (readers go on); the rename and the index row go
together under it. After a write error the writer backs off (``ssd_health``) and tries again,
and while the tier is off it retries opening its folder.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from promptcache.core.block_file import commit_temp, encode_block, seal_file, write_temp
from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.base import BlockRecord
from promptcache.core.tiers.ssd.health import WriteHealth
from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.lock import CacheDirLockedError
from promptcache.core.tiers.ssd.stats import SsdStats

log = logging.getLogger("promptcache.ssd")


class SsdWrites:
    """The write half of ``SsdTier`` (a mixin: the tier owns the state below)."""

    model: str
    root_dir: Path
    codec: PayloadCodec
    stats: SsdStats
    health: WriteHealth
    index: SsdIndex | None
    files_lock: threading.RLock
    _closed: bool
    _pending: dict[BlockHash, bool]
    _pending_lock: threading.Lock
    _queue: queue.Queue[BlockRecord | None]
    clock: Callable[[], float]
    cipher: BlockCipher | None
    _pending_tags: dict[BlockHash, list[BlockUse]]
    _apply_pending_tags: Callable[[BlockHash, float], None]  # from SsdSessions

    def _open(self) -> bool:
        raise NotImplementedError

    def _open_failed(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _path_for(self, root: BlockHash, block_hash: BlockHash) -> Path:
        raise NotImplementedError

    def _tenant(self, root: BlockHash) -> str:
        raise NotImplementedError

    def enforce_capacity(self) -> None:
        raise NotImplementedError

    def put(self, record: BlockRecord) -> bool:
        index = self.index
        if self._closed or index is None:
            return False
        if not self.health.may_write():  # backing off after a write error
            self.stats.add(skipped_writes=1)
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
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self.stats.add(dropped_writes=1)
                return False
            self._pending[record.block_hash] = has_checkpoint or bool(queued)
        return True

    def _write_loop(self) -> None:
        last_enforce = 0.0
        while True:
            if self.index is None and not self._closed and self.health.may_write():
                self._reopen()
            try:
                # while off, wake up to retry opening the folder; otherwise wait for work
                wait = max(0.05, self.health.seconds_to_retry()) if self.index is None else None
                record = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if record is None:
                self._queue.task_done()
                break
            try:
                if not self.health.may_write():
                    self.stats.add(skipped_writes=1)
                    continue
                self._write(record)
                if self.health.succeeded():
                    self.stats.add(num_recoveries=1)
                    log.warning("SSD writes work again (after %s)", self.stats.get("last_error"))
                # the budget holds again before the write counts as done (flush() waits for it)
                if time.monotonic() - last_enforce > 1.0 or self._queue.empty():
                    self.enforce_capacity()
                    last_enforce = time.monotonic()
            except Exception as exc:  # disk full, read-only, ...: keep serving from RAM
                delay = self.health.failed()
                self.stats.error(f"{type(exc).__name__}: {exc}", write_errors=1)
                # at most one error per cool-down: each one is worth a line
                log.warning(
                    "SSD write failed (%d so far): %s; writes skipped for %.1f s",
                    self.stats.get("write_errors"),
                    exc,
                    delay,
                )
            finally:
                with self._pending_lock:
                    if self._pending.get(record.block_hash) == (record.checkpoint is not None):
                        del self._pending[record.block_hash]
                        self._pending_tags.pop(record.block_hash, None)
                self._queue.task_done()

    def _reopen(self) -> None:
        try:
            opened = self._open()
        except CacheDirLockedError as exc:
            opened = self._open_failed(exc)
        if opened:
            self.health.succeeded()
            self.stats.add(num_recoveries=1)
            log.warning("SSD tier on again in %s", self.root_dir)

    def _write(self, record: BlockRecord) -> None:
        index = self.index
        assert index is not None
        meta = record.meta
        path = self._path_for(meta.root, meta.block_hash)
        data = seal_file(encode_block(record, self.model, self.codec), self.cipher, path.stem)
        tmp = write_temp(path, data)  # the slow part (fsync) outside the lock: reads go on
        with self.files_lock:
            commit_temp(tmp, path)
            now = self.clock()
            old = index.get(meta.block_hash)
            row = Row(
                meta,
                str(path.relative_to(self.root_dir)),
                len(data),
                record.nbytes,
                record.checkpoint is not None,
                record.is_seq_end,
                old.created if old else now,
                now,
            )
            try:
                index.upsert(row, self._tenant(meta.root), record.sessions, record.ttl_s)
                self._apply_pending_tags(meta.block_hash, now)
            except BaseException:  # no file without its row: it would hold bytes off the budget
                path.unlink(missing_ok=True)
                with contextlib.suppress(sqlite3.Error):
                    index.delete([meta.block_hash])
                raise
        self.stats.add(num_writes=1, bytes_written=len(data))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False
