"""SSD tier: persistent, crash-safe block store behind the RAM tier.

Every new block is written through in the background (a writer thread, bounded queue; when full,
writes are dropped and counted, never blocking a request), so a crash keeps what was written.
Lookups walk the SQLite index; promotion reads files back, verifying checksums and chained
hashes. A damaged file is moved to ``quarantine/`` and never served. The model's folder is
private (0700/0600) and locked by one process for the tier's life (``ssd_lock``); after a write
error the tier backs off and tries again (``ssd_health``), so it comes back once space is back.
"""

from __future__ import annotations

import io
import logging
import queue
import re
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from promptcache.core.block_file import (
    SUFFIX,
    CorruptBlockError,
    commit_temp,
    decode_block,
    encode_block,
    prefetch_files,
    read_open_file,
    verify_identity,
    write_temp,
)
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.hashing import BlockHash
from promptcache.core.private_fs import (
    FILE_MODE,
    make_private_dirs,
    tighten_shared_parent,
    tighten_tree,
)
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_capacity import enforce_capacity
from promptcache.core.ssd_health import WriteHealth
from promptcache.core.ssd_index import Row, SsdIndex
from promptcache.core.ssd_lock import CacheDirLock, CacheDirLockedError
from promptcache.core.ssd_reconcile import matches_row, reconcile_dir
from promptcache.core.ssd_stats import SsdStats
from promptcache.core.tier import BlockRecord
from promptcache.core.tree import common_prefix_tokens

log = logging.getLogger("promptcache.ssd")
_READERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="promptcache-ssd-read")
DEFAULT_SSD_BUDGET = 10 * 10**9
RETRY_S = 5.0  # first cool-down after a write error (it doubles while errors go on)
MAX_TENANT_NAMES = 4096  # namespace root -> tenant for folder names; bounded against header spam


class BlockEvictedError(CorruptBlockError):
    """The block was evicted between lookup and read: the hit ends there; nothing is damaged."""


class SsdTier:
    name = "ssd"
    write_through = True

    def __init__(
        self,
        cache_dir: str | Path,
        model_fingerprint: str,
        *,
        codec: PayloadCodec | None = None,
        budget_bytes: int = DEFAULT_SSD_BUDGET,
        retention_s: float | None = None,
        queue_blocks: int = 64,
        retry_s: float | None = None,
    ) -> None:
        """Raises CacheDirLockedError when another process uses this model's cache folder; any
        other start-up failure (unusable folder, full disk) leaves the tier off, retried later."""
        self.model = model_fingerprint
        self.cache_dir = Path(cache_dir)
        self.root_dir = self.cache_dir / model_fingerprint[:16]
        self.quarantine_dir = self.root_dir / "quarantine"
        self.codec = codec or TreeCodec()
        self.budget_bytes = budget_bytes
        self.retention_s = retention_s
        self.stats = SsdStats()
        self.health = WriteHealth(RETRY_S if retry_s is None else retry_s)
        self._tenants: OrderedDict[BlockHash, str] = OrderedDict()
        # queued hashes -> whether a queued record carries a checkpoint (a block may be queued
        # again when its checkpoint is attached after the first write-through)
        self._pending: dict[BlockHash, bool] = {}
        self._pending_lock = threading.Lock()
        # files and index rows change together under this lock (writer, eviction, quarantine);
        # readers open files under it too, so an open file is one the index still holds
        self.files_lock = threading.RLock()
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue(maxsize=queue_blocks)
        self._closed = False
        self._dir_lock = CacheDirLock(self.root_dir)
        self.index: SsdIndex | None = None
        self._open()
        self._writer = threading.Thread(
            target=self._write_loop, name="promptcache-ssd-writer", daemon=True
        )
        self._writer.start()

    def _open(self) -> bool:
        """Folder, lock, index, reconcile; False (tier off, retried) on an unusable folder."""
        try:
            make_private_dirs(self.root_dir)
            tighten_shared_parent(self.cache_dir)
            self._dir_lock.acquire()
        except CacheDirLockedError:
            raise
        except OSError as exc:
            return self._open_failed(exc)
        try:
            tighten_tree(self.root_dir)
            index = SsdIndex(self.root_dir / "index.sqlite")
            with self.files_lock:
                self.index = index
                reconcile_dir(self, index)
        except (OSError, sqlite3.Error) as exc:  # e.g. a full disk: the index cannot be created
            self.index = None
            self._dir_lock.release()
            return self._open_failed(exc)
        return True

    def _open_failed(self, exc: BaseException) -> bool:
        delay = self.health.failed()
        self.stats.error(f"{type(exc).__name__}: {exc}")
        log.error("SSD tier off: cannot use %s: %s (retrying in %.1f s)", self.root_dir, exc, delay)
        return False

    @property
    def is_enabled(self) -> bool:
        return self.index is not None

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        """Remember the tenant's name for folder names; its record is written with its first
        block (and pruned with its last), so namespaces without blocks leave nothing on disk."""
        with self._pending_lock:
            self._tenants[root] = tenant
            self._tenants.move_to_end(root)
            if len(self._tenants) > MAX_TENANT_NAMES:
                self._tenants.popitem(last=False)

    def _tenant(self, root: BlockHash) -> str:
        with self._pending_lock:
            return self._tenants.get(root, "")

    def _path_for(self, root: BlockHash, block_hash: BlockHash) -> Path:
        tenant = re.sub(r"[^A-Za-z0-9_.-]", "_", self._tenant(root))[:40] or "default"
        h = block_hash.hex()
        return self.root_dir / f"{tenant}-{root.hex()[:8]}" / h[:2] / (h + SUFFIX)

    # -- writes ------------------------------------------------------------------------------

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
                errors = self.stats.get("write_errors")
                if errors in (1, 10, 100) or errors % 1000 == 0:
                    log.warning(
                        "SSD write failed (%d so far): %s; retrying in %.1f s", errors, exc, delay
                    )
            finally:
                with self._pending_lock:
                    if self._pending.get(record.block_hash) == (record.checkpoint is not None):
                        del self._pending[record.block_hash]
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
        root = record.root
        path = self._path_for(root, record.block_hash)
        data = encode_block(record, root, self.model, self.codec)
        tmp = write_temp(path, data)  # the slow part (fsync) outside the lock: reads go on
        with self.files_lock:
            commit_temp(tmp, path)
            now = time.time()
            old = index.get(record.block_hash)
            row = Row(
                record.block_hash,
                record.parent_hash,
                root,
                record.token_bytes,
                record.extra,
                int.from_bytes(record.token_bytes[:4], "little"),
                record.depth,
                str(path.relative_to(self.root_dir)),
                len(data),
                record.nbytes,
                record.checkpoint is not None,
                record.is_seq_end,
                old.created if old else now,
                now,
            )  # fmt: skip
            index.upsert(row, self._tenant(root))
        self.stats.add(num_writes=1, bytes_written=len(data))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=30)
        with self.files_lock:
            if self.index is not None:
                self.index.close()
            self._dir_lock.release()

    # -- capacity ----------------------------------------------------------------------------

    def enforce_capacity(self) -> None:
        index = self.index
        if index is None:
            return
        with self.files_lock:
            enforce_capacity(self, index)

    # -- reads -------------------------------------------------------------------------------

    def find_chain(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[Row]:
        """Indexed blocks continuing ``seq`` after full block ``start - 1`` (hash ``parent``):
        whole blocks by hash, then the child sharing the longest prefix with what follows (with
        ``requires_checkpoint``: the longest child that ``seq`` covers whole and that ends in a
        checkpoint, since a hit can only end on one)."""
        if self.index is None or self._closed:
            return []
        rows: list[Row] = []
        b, n = seq.block_size, seq.num_tokens
        for i in range(start, seq.num_full_blocks):
            r = self.index.get(seq.block_hash(i))
            if (
                r is None
                or r.parent != parent
                or r.token_bytes != seq.block_bytes(i * b, (i + 1) * b)
                or r.extra != seq.extra(i)
            ):
                break
            rows.append(r)
            parent = r.block_hash
        pos = (start + len(rows)) * b
        if pos < n:
            want = seq.block_bytes(pos, min(pos + b, n))
            best, best_key = None, (0, False)
            for r in self.index.children(parent, seq.token(pos)):
                common = common_prefix_tokens(r.token_bytes, want)
                if r.extra != seq.extra(pos // b):
                    continue
                if requires_checkpoint and not (
                    r.has_checkpoint and common == len(r.token_bytes) // 4
                ):
                    continue
                key = (common, r.has_checkpoint)
                if key > best_key:
                    best, best_key = r, key
            if best is not None:
                rows.append(best)
        return rows

    def read(self, row: Row) -> tuple[Any, Any]:
        """(payload, checkpoint) of an indexed block; a damaged file is quarantined and raises
        CorruptBlockError; a block evicted since the lookup raises BlockEvictedError.
        (Reload latency and throughput are recorded per promotion, by ``read_many``.)"""
        path = self.root_dir / row.path
        with self.files_lock:  # eviction cannot delete it between this check and the open
            current = self.index.get(row.block_hash) if self.index is not None else None
            if current is None or current.path != row.path:
                self.stats.add(num_read_races=1)
                raise BlockEvictedError(f"{row.path} was evicted before it was read")
            try:
                f = io.FileIO(path, "rb")  # read outside the lock
            except OSError as exc:
                self.quarantine(path, row, str(exc))
                raise CorruptBlockError(str(exc)) from None
        try:
            with f:
                data = read_open_file(f)
            info, payload, checkpoint = decode_block(data, self.codec)
            verify_identity(info, path.stem)
            if info.model != self.model or not matches_row(info, row):
                raise CorruptBlockError("file does not hold the indexed block")
        except (OSError, CorruptBlockError) as exc:
            self.quarantine(path, row, str(exc))
            raise CorruptBlockError(str(exc)) from None
        return payload, checkpoint

    def read_many(self, rows: list[Row]) -> list[tuple[Any, Any] | CorruptBlockError]:
        """``read`` for each row, several files at once (a few reads in flight beat one at a time
        on small files); a damaged file's entry is its CorruptBlockError."""

        def one(row: Row) -> tuple[Any, Any] | CorruptBlockError:
            try:
                return self.read(row)
            except CorruptBlockError as exc:
                return exc

        t0 = time.perf_counter()
        prefetch_files([self.root_dir / r.path for r in rows])
        out = [one(rows[0])] if len(rows) == 1 else list(_READERS.map(one, rows))
        nbytes = sum(
            r.file_bytes for r, res in zip(rows, out, strict=True) if not isinstance(res, Exception)
        )
        self.stats.observe_reload(time.perf_counter() - t0, nbytes)
        return out

    def touch(self, rows: list[Row]) -> None:
        index = self.index
        if index is None:
            return
        try:
            index.touch((r.block_hash for r in rows), time.time())
        except Exception as exc:
            self.stats.error(f"{type(exc).__name__}: {exc}")

    def quarantine(self, path: Path, row: Row | None, reason: str) -> None:
        log.warning("quarantined %s: %s", path.name, reason)
        with self.files_lock:
            self.stats.add(num_quarantined=1)
            try:
                if path.exists():
                    make_private_dirs(self.quarantine_dir)
                    shutil.move(
                        str(path), self.quarantine_dir / f"{path.name}.{int(time.time() * 1000)}"
                    )
            except OSError as exc:
                self.stats.error(f"{type(exc).__name__}: {exc}")
            if row is not None and self.index is not None:
                self.index.delete([row.block_hash])

    # -- checks ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        index = self.index
        return index.totals()[1] if index is not None else 0

    def check_integrity(self) -> None:
        """Bytes accounted in the index == bytes of the indexed files <= budget (writes flushed);
        every indexed file private; a namespace record only for a namespace with blocks."""
        index = self.index
        if index is None:
            return
        self.flush()
        with self.files_lock:
            rows = index.all_rows()
            held = 0
            for r in rows:
                st = (self.root_dir / r.path).stat()
                assert st.st_size == r.file_bytes, (
                    f"{r.path}: {st.st_size} bytes on disk, {r.file_bytes} indexed"
                )
                assert st.st_mode & 0o777 == FILE_MODE, f"{r.path}: mode {st.st_mode & 0o777:o}"
                held += st.st_size
            assert held == self.used_bytes()
            roots = {r.root for r in rows}
            assert set(index.tenants()) <= roots, "namespace records without blocks"
        assert held <= self.budget_bytes, (
            f"SSD tier holds {held} bytes over its budget {self.budget_bytes}"
        )

    def describe(self) -> dict[str, Any]:
        index = self.index
        n, used = index.totals() if index is not None else (0, 0)
        return {**self.stats.to_dict(), **self.health.describe(), "num_blocks": n, "used_bytes": used,
                "budget_bytes": self.budget_bytes, "queued_writes": self._queue.qsize(),
                "enabled": index is not None}  # fmt: skip
