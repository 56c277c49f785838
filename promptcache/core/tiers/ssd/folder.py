"""The SSD tier's model folder: the state its reader, writer and sessions share, one object.

``<cache-dir>/<fingerprint[:16]>/``: private (0700/0600), locked by one process (``lock``),
reconciled at open (``reconcile``), its SQLite index (``index``; None while the tier is off),
namespace folders ``<tenant>-<root>/``, ``quarantine/``. Files and index rows change together
under ``files_lock`` (writer, eviction, quarantine); readers open files under it too, so an
open file is one the index still holds.
"""

from __future__ import annotations

import logging
import re
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from promptcache.core.block_file import SUFFIX
from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.private_fs import make_private_dirs, tighten_cache_dir, tighten_tree
from promptcache.core.tiers.ssd.capacity import enforce_capacity
from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.lock import LOCK_NAME, CacheDirLock
from promptcache.core.tiers.ssd.reconcile import reconcile_dir
from promptcache.core.tiers.ssd.stats import SsdStats
from promptcache.core.tiers.write_behind import Backoff

log = logging.getLogger("promptcache.ssd")
MAX_TENANT_NAMES = 4096  # namespace root -> tenant for folder names; bounded against header spam


class SsdFolder:
    name = "ssd"  # the tier's name, for eviction notes

    def __init__(
        self,
        cache_dir: str | Path,
        model: str,
        *,
        codec: PayloadCodec,
        budget_bytes: int,
        retention_s: float | None,
        evictions: EvictionLog | None,
        clock: Callable[[], float],
        cipher: BlockCipher | None,
        health: Backoff,
    ) -> None:
        self.model = model
        self.cache_dir = Path(cache_dir)
        self.root_dir = self.cache_dir / model[:16]
        self.quarantine_dir = self.root_dir / "quarantine"
        self.codec = codec
        self.budget_bytes = budget_bytes
        self.retention_s = retention_s
        self.clock = clock
        self.cipher = cipher
        self.stats = SsdStats()
        self.evictions = evictions  # shared with the cache: a miss can say "evicted from ssd"
        self.health = health  # the cool-down after a write error or an unusable folder
        self.files_lock = threading.RLock()
        self.index: SsdIndex | None = None
        self.is_closed = False
        self._dir_lock = CacheDirLock(self.root_dir)
        self._tenants: OrderedDict[BlockHash, str] = OrderedDict()
        self._tenants_lock = threading.Lock()

    def open(self) -> bool:
        """Folder, lock, index, reconcile; False (tier off, retried) on an unusable folder.
        Raises CacheDirLockedError when another process holds the folder."""
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
            return self.open_failed(exc)
        return True

    def open_failed(self, exc: BaseException) -> bool:
        delay = self.health.failed()
        self.stats.error(f"{type(exc).__name__}: {exc}")
        log.error("SSD tier off: cannot use %s: %s (retrying in %.1f s)", self.root_dir, exc, delay)
        return False

    def close(self) -> None:
        with self.files_lock:
            if self.index is not None:
                self.index.close()
            self._dir_lock.release()

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        """Remember the tenant's name for folder names; its record is written with its first
        block (and pruned with its last), so namespaces without blocks leave nothing on disk."""
        with self._tenants_lock:
            self._tenants[root] = tenant
            self._tenants.move_to_end(root)
            if len(self._tenants) > MAX_TENANT_NAMES:
                self._tenants.popitem(last=False)

    def tenant(self, root: BlockHash) -> str:
        with self._tenants_lock:
            return self._tenants.get(root, "")

    def path_for(self, root: BlockHash, block_hash: BlockHash) -> Path:
        tenant = re.sub(r"[^A-Za-z0-9_.-]", "_", self.tenant(root))[:40] or "default"
        h = block_hash.hex()
        return self.root_dir / f"{tenant}-{root.hex()[:8]}" / h[:2] / (h + SUFFIX)

    # -- capacity and damage -----------------------------------------------------------------

    def enforce_capacity(self) -> None:
        """TTL hints, retention, then LRU leaves until the budget holds (``capacity``)."""
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
