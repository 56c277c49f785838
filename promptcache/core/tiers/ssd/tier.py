"""SSD tier: persistent, crash-safe block store behind the RAM tier.

Every new block is written through in the background (a writer thread, bounded queue; when full,
writes are dropped and counted, never blocking a request), so a crash keeps what was written.
Lookups walk the SQLite index; promotion reads files back, verifying checksums and chained
hashes. A damaged file is moved to ``quarantine/`` and never served. The model's folder is
private (0700/0600) and locked by one process for the tier's life (``ssd_lock``); after a write
error the tier backs off and tries again (``ssd_health``), so it comes back once space is back.
"""

from __future__ import annotations

import logging
import queue
import re
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from promptcache.core.block_file import SUFFIX
from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.private_fs import (
    FILE_MODE,
    make_private_dirs,
    tighten_cache_dir,
    tighten_tree,
)
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.base import BlockRecord, register_tier
from promptcache.core.tiers.ssd.capacity import enforce_capacity
from promptcache.core.tiers.ssd.health import WriteHealth
from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.lock import LOCK_NAME, CacheDirLock
from promptcache.core.tiers.ssd.read import SsdReads
from promptcache.core.tiers.ssd.reconcile import reconcile_dir
from promptcache.core.tiers.ssd.sessions import SsdSessions
from promptcache.core.tiers.ssd.stats import SsdStats
from promptcache.core.tiers.ssd.write import SsdWrites

log = logging.getLogger("promptcache.ssd")
DEFAULT_SSD_BUDGET = 10 * 10**9
RETRY_S = 5.0  # first cool-down after a write error (it doubles while errors go on)
MAX_TENANT_NAMES = 4096  # namespace root -> tenant for folder names; bounded against header spam


class SsdTier(SsdReads, SsdWrites, SsdSessions):
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
        evictions: EvictionLog | None = None,
        clock: Callable[[], float] = time.time,
        cipher: BlockCipher | None = None,
    ) -> None:
        """``clock``: wall-clock seconds for access times and expiry (a test's fake clock).
        ``cipher``: encrypt files and the index's token ids at rest (``core.cipher``).
        Raises CacheDirLockedError when another process uses this model's cache folder; any
        other start-up failure (unusable folder, full disk) leaves the tier off, retried later."""
        self.model = model_fingerprint
        self.cache_dir = Path(cache_dir)
        self.root_dir = self.cache_dir / model_fingerprint[:16]
        self.quarantine_dir = self.root_dir / "quarantine"
        self.codec = codec or TreeCodec()
        self.budget_bytes = budget_bytes
        self.retention_s = retention_s
        self.clock = clock
        self.cipher = cipher
        self.stats = SsdStats()
        self.evictions = evictions  # shared with the cache: a miss can say "evicted from ssd"
        self.health = WriteHealth(RETRY_S if retry_s is None else retry_s)
        self._tenants: OrderedDict[BlockHash, str] = OrderedDict()
        # queued hashes -> whether a queued record carries a checkpoint (a block may be queued
        # again when its checkpoint is attached after the first write-through)
        self._pending: dict[BlockHash, bool] = {}
        self._pending_lock = threading.Lock()
        self._pending_tags: dict[BlockHash, list[BlockUse]] = {}
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
        index: SsdIndex | None = None
        try:
            make_private_dirs(self.root_dir)
            self._dir_lock.acquire()  # CacheDirLockedError goes to the caller
            tighten_cache_dir(self.cache_dir, LOCK_NAME)
            tighten_tree(self.root_dir)
            index = SsdIndex(self.root_dir / "index.sqlite", self.cipher)
            with self.files_lock:
                self.index = index
                reconcile_dir(self, index)
        except (OSError, sqlite3.Error) as exc:  # e.g. a full disk: the index cannot be created
            self.index = None
            if index is not None:
                index.close()
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
            roots = {r.meta.root for r in rows}
            assert set(index.tenants()) <= roots, "namespace records without blocks"
            assert index.orphan_tags() == 0, "session tags or TTLs of blocks that are gone"
        assert held <= self.budget_bytes, (
            f"SSD tier holds {held} bytes over its budget {self.budget_bytes}"
        )

    def describe(self) -> dict[str, Any]:
        index = self.index
        n, used = index.totals() if index is not None else (0, 0)
        return {**self.stats.to_dict(), **self.health.describe(), "num_blocks": n, "used_bytes": used,
                "budget_bytes": self.budget_bytes, "queued_writes": self._queue.qsize(),
                "enabled": index is not None, "encrypted": self.cipher is not None}  # fmt: skip


register_tier("ssd", SsdTier)
