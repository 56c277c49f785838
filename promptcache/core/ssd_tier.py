"""SSD tier: persistent, crash-safe block store behind the RAM tier.

Every new block is written through in the background (a writer thread, bounded queue; when full,
writes are dropped and counted, never blocking a request), so a crash keeps what was written.
Lookups walk the SQLite index; promotion reads files back, verifying checksums. A damaged file
is moved to ``quarantine/`` and never served.
"""

from __future__ import annotations

import logging
import queue
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from promptcache.core.block_file import (
    SUFFIX,
    CorruptBlockError,
    decode_block,
    encode_block,
    prefetch_files,
    read_file,
    write_atomic,
)
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_index import Row, SsdIndex
from promptcache.core.ssd_reconcile import reconcile_dir
from promptcache.core.ssd_stats import SsdStats
from promptcache.core.tier import BlockRecord
from promptcache.core.tree import common_prefix_tokens

log = logging.getLogger("promptcache.ssd")
_READERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="promptcache-ssd-read")
DEFAULT_SSD_BUDGET = 10 * 10**9


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
    ) -> None:
        self.model = model_fingerprint
        self.root_dir = Path(cache_dir) / model_fingerprint[:16]
        self.quarantine_dir = self.root_dir / "quarantine"
        self.codec = codec or TreeCodec()
        self.budget_bytes = budget_bytes
        self.retention_s = retention_s
        self.stats = SsdStats()
        self._tenants: dict[BlockHash, str] = {}
        # queued hashes -> whether a queued record carries a checkpoint (a block may be queued
        # again when its checkpoint is attached after the first write-through)
        self._pending: dict[BlockHash, bool] = {}
        self._pending_lock = threading.Lock()
        # files and index rows change together under this lock (writer, eviction, quarantine)
        self._files_lock = threading.RLock()
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue(maxsize=queue_blocks)
        self._closed = False
        try:
            self.root_dir.mkdir(parents=True, exist_ok=True)
            self.index = SsdIndex(self.root_dir / "index.sqlite")
        except Exception as exc:  # sqlite3.Error, OSError: read-only or unusable dir: RAM only
            log.error("SSD tier disabled: cannot open %s: %s", self.root_dir, exc)
            self.stats.last_error = str(exc)
            self.index = None  # type: ignore[assignment]
            self._closed = True
            return
        self.reconcile()
        self._writer = threading.Thread(
            target=self._write_loop, name="promptcache-ssd-writer", daemon=True
        )
        self._writer.start()

    @property
    def is_enabled(self) -> bool:
        return self.index is not None

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        if root not in self._tenants and self.index is not None:
            self._tenants[root] = tenant
            try:
                self.index.set_tenant(root, tenant)
            except Exception as exc:
                self.stats.write_errors += 1
                self.stats.last_error = str(exc)

    def _path_for(self, root: BlockHash, block_hash: BlockHash) -> Path:
        tenant = re.sub(r"[^A-Za-z0-9_.-]", "_", self._tenants.get(root, ""))[:40] or "default"
        h = block_hash.hex()
        return self.root_dir / f"{tenant}-{root.hex()[:8]}" / h[:2] / (h + SUFFIX)

    # -- writes ------------------------------------------------------------------------------

    def put(self, record: BlockRecord) -> bool:
        if self._closed:
            return False
        has_checkpoint = record.checkpoint is not None
        with self._pending_lock:
            queued = self._pending.get(record.block_hash)
            if queued is not None and (queued or not has_checkpoint):
                return True
        row = self.index.get(record.block_hash)
        if row is not None and (row.has_checkpoint or record.checkpoint is None):
            return True
        with self._pending_lock:
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self.stats.dropped_writes += 1
                return False
            self._pending[record.block_hash] = has_checkpoint or bool(queued)
        return True

    def _write_loop(self) -> None:
        last_enforce = 0.0
        while True:
            record = self._queue.get()
            if record is None:
                self._queue.task_done()
                break
            try:
                self._write(record)
                # the budget holds again before the write counts as done (flush() waits for it)
                if time.monotonic() - last_enforce > 1.0 or self._queue.empty():
                    self.enforce_capacity()
                    last_enforce = time.monotonic()
            except Exception as exc:  # disk full, read-only, ...: keep serving from RAM
                self.stats.write_errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                if self.stats.write_errors in (1, 10, 100) or self.stats.write_errors % 1000 == 0:
                    log.warning("SSD write failed (%d so far): %s", self.stats.write_errors, exc)
            finally:
                with self._pending_lock:
                    if self._pending.get(record.block_hash) == (record.checkpoint is not None):
                        del self._pending[record.block_hash]
                self._queue.task_done()

    def _write(self, record: BlockRecord) -> None:
        root = record.root
        path = self._path_for(root, record.block_hash)
        data = encode_block(record, root, self.model, self.codec)
        with self._files_lock:
            self._write_file(record, root, path, data)

    def _write_file(self, record: BlockRecord, root: BlockHash, path: Path, data: bytes) -> None:
        write_atomic(path, data)
        now = time.time()
        old = self.index.get(record.block_hash)
        self.index.upsert(
            Row(
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
        )
        self.stats.num_writes += 1
        self.stats.bytes_written += len(data)

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
        self.index.close()

    # -- capacity ----------------------------------------------------------------------------

    def enforce_capacity(self) -> None:
        if self.index is None:
            return
        with self._files_lock:
            self._enforce_capacity()

    def _enforce_capacity(self) -> None:
        if self.retention_s is not None:
            cutoff = time.time() - self.retention_s
            while True:
                old = [r for r in self.index.lru_leaves(256) if r.last_access < cutoff]
                if not old:
                    break
                self._delete(old)
                self.stats.num_expired += len(old)
        _, used = self.index.totals()
        while used > self.budget_bytes:
            leaves = self.index.lru_leaves(64)
            if not leaves:
                break
            for r in leaves:
                if used <= self.budget_bytes:
                    break
                self._delete([r])
                self.stats.num_evictions += 1
                used -= r.file_bytes

    def _delete(self, rows: list[Row]) -> None:
        with self._files_lock:
            for r in rows:
                (self.root_dir / r.path).unlink(missing_ok=True)
            self.index.delete(r.block_hash for r in rows)

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
        """(payload, checkpoint) of an indexed block; a damaged file is quarantined and raises.
        (Reload latency and throughput are recorded per promotion, by ``read_many``.)"""
        path = self.root_dir / row.path
        try:
            data = read_file(path)
            info, payload, checkpoint = decode_block(data, self.codec)
            if (
                info.block_hash != row.block_hash
                or info.model != self.model
                or info.token_bytes != row.token_bytes
            ):
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
        try:
            self.index.touch((r.block_hash for r in rows), time.time())
        except Exception as exc:
            self.stats.last_error = str(exc)

    def quarantine(self, path: Path, row: Row | None, reason: str) -> None:
        log.warning("quarantined %s: %s", path.name, reason)
        with self._files_lock:
            self._quarantine(path, row)

    def _quarantine(self, path: Path, row: Row | None) -> None:
        self.stats.num_quarantined += 1
        try:
            if path.exists():
                self.quarantine_dir.mkdir(parents=True, exist_ok=True)
                shutil.move(
                    str(path), self.quarantine_dir / f"{path.name}.{int(time.time() * 1000)}"
                )
        except OSError as exc:
            self.stats.last_error = str(exc)
        if row is not None:
            self.index.delete([row.block_hash])

    # -- start-up ----------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Make index and files agree again after a crash (see ``ssd_reconcile``)."""
        reconcile_dir(self)

    # -- checks ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return self.index.totals()[1] if self.index is not None else 0

    def check_integrity(self) -> None:
        """Bytes accounted in the index == bytes of the indexed files <= budget (writes flushed)."""
        if self.index is None:
            return
        self.flush()
        with self._files_lock:
            rows = self.index.all_rows()
            held = 0
            for r in rows:
                size = (self.root_dir / r.path).stat().st_size
                assert size == r.file_bytes, (
                    f"{r.path}: {size} bytes on disk, {r.file_bytes} indexed"
                )
                held += size
            assert held == self.used_bytes()
        assert held <= self.budget_bytes, (
            f"SSD tier holds {held} bytes over its budget {self.budget_bytes}"
        )

    def describe(self) -> dict[str, Any]:
        n, used = self.index.totals() if self.index is not None else (0, 0)
        return {**self.stats.to_dict(), "num_blocks": n, "used_bytes": used, "budget_bytes": self.budget_bytes,
                "queued_writes": self._queue.qsize(), "enabled": self.index is not None}  # fmt: skip
