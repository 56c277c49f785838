"""Reads of the SSD tier (``SsdReader``): walk the index for a continuation, read files back
verified.

A reader opens a file under the tier's files lock after checking that the index still holds
it, so eviction cannot delete it in between; once open, the file reads whole even if it is
evicted meanwhile (the open descriptor keeps it). A block evicted before the open ends the hit
without a quarantine: nothing is damaged.
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

from promptcache.core.block import BlockMeta
from promptcache.core.block_file import (
    CorruptBlockError,
    decode_block,
    prefetch_files,
    read_open_file,
    unseal_file,
    verify_identity,
)
from promptcache.core.chain import checkpoint_path, match_chain
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import ReadResult, StoredBlock
from promptcache.core.tiers.ssd.folder import SsdFolder
from promptcache.core.tiers.ssd.reconcile import matches_row
from promptcache.core.worker_threads import worker_initializer

_READERS = ThreadPoolExecutor(
    max_workers=2, thread_name_prefix="promptcache-ssd-read", initializer=worker_initializer
)


class BlockEvictedError(CorruptBlockError):
    """The block was evicted between lookup and read: the hit ends there; nothing is damaged."""

    is_damage = False


class SsdReader:
    """The SSD tier's ``lookup``/``read`` half, over its folder."""

    def __init__(self, folder: SsdFolder) -> None:
        self.folder = folder

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[StoredBlock]:
        """Indexed blocks continuing ``seq`` after full block ``start - 1`` (hash ``parent``):
        the shared walk (``chain.match_chain``); with ``requires_checkpoint`` only as far as
        the deepest checkpoint a hit could end on (``chain.checkpoint_path``)."""
        f = self.folder
        index = f.index
        if index is None or f.is_closed:
            return []
        full, tail, _ = match_chain(index, seq, start, parent)
        if requires_checkpoint:
            rows = checkpoint_path(index, seq, start, parent, full)
        else:
            rows = full if tail is None else [*full, tail]
        return [StoredBlock(r.meta, r.payload_nbytes, r.has_checkpoint, r.is_seq_end) for r in rows]

    def _read_one(self, meta: BlockMeta) -> tuple[ReadResult, int]:
        """((payload, checkpoint) or the error, file bytes read). A damaged file is
        quarantined (CorruptBlockError); a block evicted since the lookup is a
        BlockEvictedError."""
        f = self.folder
        with f.files_lock:  # eviction cannot delete it between this check and the open
            row = f.index.get(meta.block_hash) if f.index is not None else None
            if row is None or row.meta != meta:
                f.stats.add(num_read_races=1)
                return BlockEvictedError(
                    f"{meta.block_hash.hex()} was evicted before it was read"
                ), 0
            path = f.root_dir / row.path
            try:
                fh = io.FileIO(path, "rb")  # read outside the lock
            except OSError as exc:
                f.quarantine(path, row, str(exc))
                return CorruptBlockError(str(exc)), 0
        try:
            with fh:
                data = read_open_file(fh)
            info, payload, checkpoint = decode_block(
                unseal_file(data, f.cipher, path.stem), f.codec
            )
            verify_identity(info, path.stem)
            if info.model != f.model or not matches_row(info, row):
                raise CorruptBlockError("file does not hold the indexed block")
        except (OSError, CorruptBlockError) as exc:
            f.quarantine(path, row, str(exc))
            return CorruptBlockError(str(exc)), 0
        return (payload, checkpoint), row.file_bytes

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        """Each block's (payload, checkpoint), several files at once (a few reads in flight
        beat one at a time on small files); a damaged or evicted block's entry is its
        CorruptBlockError. Records the reload's latency and throughput."""
        f = self.folder
        if not blocks:
            return []
        t0 = time.perf_counter()
        index = f.index
        if index is not None:
            prefetch_files([f.root_dir / r.path for b in blocks if (r := index.get(b.block_hash))])
        metas = [b.meta for b in blocks]
        out = (
            [self._read_one(metas[0])]
            if len(metas) == 1
            else list(_READERS.map(self._read_one, metas))
        )
        f.stats.observe_reload(time.perf_counter() - t0, sum(n for _, n in out))
        return [res for res, _ in out]

    def touch(self, hashes: list[BlockHash]) -> None:
        """A promotion from this tier: count the hit, refresh the blocks' access times."""
        f = self.folder
        f.stats.add(num_hits=1, num_promoted_blocks=len(hashes))
        index = f.index
        if index is None:
            return
        try:
            index.touch(hashes, f.clock())
        except Exception as exc:
            f.stats.error(f"{type(exc).__name__}: {exc}")

    def note_miss(self, failed: bool) -> None:
        self.folder.stats.add(**{"promotion_failures" if failed else "num_misses": 1})
