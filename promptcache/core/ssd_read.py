"""Reads of the SSD tier: walk the index for a continuation, read files back verified.

A reader opens a file under the tier's files lock after checking that the index still holds
it, so eviction cannot delete it in between; once open, the file reads whole even if it is
evicted meanwhile (the open descriptor keeps it). A block evicted before the open ends the hit
without a quarantine: nothing is damaged.
"""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from promptcache.core.block_file import (
    CorruptBlockError,
    decode_block,
    prefetch_files,
    read_open_file,
    verify_identity,
)
from promptcache.core.chain import checkpoint_path, match_chain
from promptcache.core.codec import PayloadCodec
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_index import Row, SsdIndex
from promptcache.core.ssd_reconcile import matches_row
from promptcache.core.ssd_stats import SsdStats

_READERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="promptcache-ssd-read")


class BlockEvictedError(CorruptBlockError):
    """The block was evicted between lookup and read: the hit ends there; nothing is damaged."""


class SsdReads:
    """The read half of ``SsdTier`` (a mixin: the tier owns the state below)."""

    model: str
    root_dir: Path
    codec: PayloadCodec
    stats: SsdStats
    index: SsdIndex | None
    files_lock: threading.RLock
    _closed: bool

    def quarantine(self, path: Path, row: Row | None, reason: str) -> None:
        raise NotImplementedError

    def find_chain(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[Row]:
        """Indexed blocks continuing ``seq`` after full block ``start - 1`` (hash ``parent``):
        the shared walk (``chain.match_chain``); with ``requires_checkpoint`` only as far as
        the deepest checkpoint a hit could end on (``chain.checkpoint_path``)."""
        index = self.index
        if index is None or self._closed:
            return []
        full, tail, _ = match_chain(index, seq, start, parent)
        if requires_checkpoint:
            return checkpoint_path(index, seq, start, parent, full)
        return full if tail is None else [*full, tail]

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
