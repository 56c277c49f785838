"""SSD tier: persistent, crash-safe block store behind the RAM tier.

Every new block is written through in the background (a writer thread, bounded queue; when full,
writes are dropped and counted, never blocking a request), so a crash keeps what was written.
Lookups walk the SQLite index; promotion reads files back, verifying checksums and chained
hashes. A damaged file is moved to ``quarantine/`` and never served. The model's folder is
private (0700/0600) and locked by one process for the tier's life (``lock``); after a write
error the tier backs off and tries again (``write_behind.Backoff``), so it comes back once space
is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.figures import Series, Snapshot
from promptcache.core.hashing import BlockHash
from promptcache.core.private_fs import FILE_MODE
from promptcache.core.tiers.parts import PartsTier
from promptcache.core.tiers.ssd.folder import SsdFolder
from promptcache.core.tiers.ssd.index import Row, SsdIndex
from promptcache.core.tiers.ssd.read import SsdReader
from promptcache.core.tiers.ssd.sessions import SsdSessions
from promptcache.core.tiers.ssd.stats import SsdStats
from promptcache.core.tiers.ssd.write import SsdWriter
from promptcache.core.tiers.write_behind import Backoff

DEFAULT_SSD_BUDGET = 10 * 10**9
RETRY_S = 5.0  # first cool-down after a write error (it doubles while errors go on)


class SsdTier(PartsTier):
    """A ``BlockStore`` (with feedback, session admin, stats and checks) composed of explicit parts over one ``SsdFolder``: ``reader`` (lookup,
    verified reads), ``writer`` (write-behind queue, back-off), ``sessions`` (tags, deletion,
    expiry)."""

    name = "ssd"
    write_through = True
    reader: SsdReader
    writer: SsdWriter
    sessions: SsdSessions

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
        self.folder = SsdFolder(
            cache_dir,
            model_fingerprint,
            codec=codec or TreeCodec(),
            budget_bytes=budget_bytes,
            retention_s=retention_s,
            evictions=evictions,
            clock=clock,
            cipher=cipher,
            health=Backoff(RETRY_S if retry_s is None else retry_s),
        )
        self.folder.open()
        self.reader = SsdReader(self.folder)
        self.writer = SsdWriter(self.folder, queue_blocks)
        self.sessions = SsdSessions(self.folder, self.writer)

    # -- the folder's facts, read by tests, the CLI and the checks ---------------------------

    @property
    def model(self) -> str:
        return self.folder.model

    @property
    def root_dir(self) -> Path:
        return self.folder.root_dir

    @property
    def quarantine_dir(self) -> Path:
        return self.folder.quarantine_dir

    @property
    def budget_bytes(self) -> int:
        return self.folder.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, nbytes: int) -> None:  # takes effect at the next capacity pass
        self.folder.budget_bytes = nbytes

    @property
    def stats(self) -> SsdStats:
        return self.folder.stats

    @property
    def index(self) -> SsdIndex | None:
        return self.folder.index

    @property
    def is_enabled(self) -> bool:
        return self.folder.index is not None

    @property
    def num_queued_writes(self) -> int:
        return self.writer.queue.num_queued

    # -- LookupFeedback (the rest of BlockStore is the parts') ---------------------------------

    def touch(self, hashes: list[BlockHash]) -> None:
        self.reader.touch(hashes)

    # -- SessionAdmin ---------------------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        self.folder.register_namespace(root, tenant)

    def enforce_capacity(self) -> None:
        self.folder.enforce_capacity()

    def quarantine(self, path: Path, row: Row | None, reason: str) -> None:
        self.folder.quarantine(path, row, reason)

    def close(self) -> None:
        if self.folder.is_closed:
            return
        self.flush()
        self.folder.is_closed = True
        self.writer.close()
        self.folder.close()

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
        with self.folder.files_lock:
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

    def describe(self) -> Snapshot:
        index = self.index
        n, used = index.totals() if index is not None else (0, 0)
        health = self.folder.health
        counts, series = self.stats.figures()
        own = {"num_blocks": n, "used_bytes": used, "budget_bytes": self.budget_bytes,
               "queued_writes": self.num_queued_writes, "queued_write_bytes": self.queued_bytes(),
               "consecutive_write_errors": health.num_failures,
               "retry_in_s": round(health.seconds_to_retry(), 3)}  # fmt: skip
        series += [Series(k, "gauge", v) for k, v in own.items()]
        flags = {"write_state": "backing_off" if health.num_failures else "ok",
                 "enabled": index is not None, "encrypted": self.folder.cipher is not None}  # fmt: skip
        return Snapshot({**counts, **own, **flags}, tuple(series))
