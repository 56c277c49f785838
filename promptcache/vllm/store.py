"""The worker's cache: our ``PromptCache`` (RAM budget, then the SSD tier and the shared tier
behind it) holding one block per vLLM block, plus the scheduler's read-only probe.

The scheduler and the worker run in different processes under vLLM's multiprocess executor,
so the scheduler cannot see the worker's RAM. ``ChainProbe`` answers "how far is this prompt
held?" from what it can see without reading a tensor: the blocks it has itself asked the
worker to save (recent, bounded), the SSD tier's SQLite index (opened read-only beside the
worker, which holds the folder's lock) and the shared tier's index on Valkey. A block it
counts that the worker then cannot load is a load error: vLLM recomputes it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from promptcache.core.cache import PromptCache
from promptcache.core.chain import chain_reach, match_chain
from promptcache.core.codec import TreeCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.factory import build_tiers
from promptcache.core.tiers.ssd.index import SsdIndex
from promptcache.core.tiers.ssd.lock import CacheDirLockedError
from promptcache.vllm.settings import ConnectorSettings

log = logging.getLogger("vllm.promptcache")  # under vLLM's logger: its handlers and level

MIRROR_BLOCKS = 1 << 16  # hashes of blocks the scheduler had saved, newest kept


def open_cache(fingerprint: str, block_size: int, settings: ConnectorSettings) -> PromptCache:
    """The worker's cache. An SSD folder another process holds (a second vLLM on the same
    folder) leaves that instance without the SSD tier, logged, rather than failing it."""
    evictions = EvictionLog()
    try:
        tiers = _tiers(fingerprint, settings, evictions, settings.cache_dir)
    except CacheDirLockedError as exc:
        log.error("promptcache: SSD tier off: %s", exc)
        tiers = _tiers(fingerprint, settings, evictions, None)
    return PromptCache(
        fingerprint,
        block_size=block_size,
        ram_budget=settings.ram_budget,
        next_tier=tiers,
        evictions=evictions,
    )


def _tiers(
    fingerprint: str, settings: ConnectorSettings, evictions: EvictionLog, cache_dir: str | None
) -> list[BlockStore]:
    return build_tiers(
        fingerprint=fingerprint,
        ssd_dir=cache_dir,
        ssd_budget=settings.ssd_budget,
        codec=TreeCodec(),
        evictions=evictions,
        shared_url=settings.shared_tier,
        shared_ttl=settings.shared_ttl,
    )


class ChainProbe:
    """The scheduler's walk: tokens of a sequence held beyond RAM-less guessing, no reads."""

    def __init__(self, fingerprint: str, settings: ConnectorSettings) -> None:
        self.fingerprint = fingerprint
        self.settings = settings
        self._saved: OrderedDict[BlockHash, BlockHash] = OrderedDict()  # hash -> parent
        self._index: SsdIndex | None = None
        self._shared: BlockStore | None = None
        if settings.shared_tier:
            tiers = build_tiers(
                fingerprint=fingerprint,
                codec=TreeCodec(),
                shared_url=settings.shared_tier,
                shared_ttl=settings.shared_ttl,
            )
            self._shared = tiers[0] if tiers else None

    def note_saved(self, seq: TokenSeq, num_blocks: int) -> None:
        """Blocks ``0 .. num_blocks - 1`` of ``seq`` were handed to the worker to save."""
        parent = seq.root
        for i in range(num_blocks):
            h = seq.block_hash(i)
            self._saved[h] = parent
            self._saved.move_to_end(h)
            parent = h
        while len(self._saved) > MIRROR_BLOCKS:
            self._saved.popitem(last=False)

    def reach(self, seq: TokenSeq) -> tuple[int, str]:
        """(tokens of ``seq`` held, the source that holds the most): never the last token."""
        limit = seq.num_tokens - 1
        best, source = self._saved_reach(seq), "ram"
        for name, found in (("ssd", self._ssd_reach(seq)), ("shared", self._shared_reach(seq))):
            if found > best:
                best, source = found, name
        return min(best, limit), source

    def _saved_reach(self, seq: TokenSeq) -> int:
        parent = seq.root
        for i in range(seq.num_full_blocks):
            h = seq.block_hash(i)
            if self._saved.get(h) != parent:
                return i * seq.block_size
            parent = h
        return seq.num_full_blocks * seq.block_size

    def _ssd_reach(self, seq: TokenSeq) -> int:
        index = self._open_index()
        if index is None:
            return 0
        try:
            full, _, _ = match_chain(index, seq, 0, seq.root)
        except Exception as exc:  # a busy or damaged index is a miss here, never an error
            log.debug("promptcache: SSD index probe failed: %s", exc)
            return 0
        return chain_reach(seq, full)

    def _shared_reach(self, seq: TokenSeq) -> int:
        if self._shared is None:
            return 0
        try:
            found = self._shared.lookup(seq, 0, seq.root, False)
        except Exception as exc:  # the tier never raises; a cache probe must not either
            log.debug("promptcache: shared tier probe failed: %s", exc)
            return 0
        return chain_reach(seq, [b for b in found if b.meta.num_tokens == seq.block_size])

    def _open_index(self) -> SsdIndex | None:
        if self._index is not None or not self.settings.cache_dir:
            return self._index
        path = Path(self.settings.cache_dir) / self.fingerprint[:16] / "index.sqlite"
        if path.exists():  # the worker creates it; until then nothing is on SSD
            try:
                self._index = SsdIndex(path, None, adopt_key=False)
            except Exception as exc:
                log.debug("promptcache: SSD index not readable yet: %s", exc)
        return self._index

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
        if self._shared is not None:
            self._shared.close()
