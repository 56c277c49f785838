"""Where recently evicted blocks went: so a miss can say "evicted" (when, from which tier)
rather than "never seen". Bounded: the oldest entries are forgotten first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import NamedTuple

from promptcache.core.hashing import BlockHash

DEFAULT_CAPACITY = 1 << 16  # hashes kept (a few MB): far more than a tier evicts between turns


class Eviction(NamedTuple):
    tier: str  # the tier the block left ("ram", "ssd", ...)
    time_s: float  # wall clock


class EvictionLog:
    """Block hash -> its last eviction, and parent hash -> the last eviction of a child (a
    partial block's hash depends on its length, so a lookup finds it through its parent).
    Thread-safe: RAM evicts under the cache lock, the SSD tier from its own threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, Eviction] = OrderedDict()
        self._children: OrderedDict[BlockHash, Eviction] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def note(
        self, block_hash: BlockHash, parent_hash: BlockHash, tier: str, now: float | None = None
    ) -> None:
        """Record that ``block_hash`` (a child of ``parent_hash``) left ``tier``."""
        ev = Eviction(tier, time.time() if now is None else now)
        with self._lock:
            for table, key in ((self._blocks, block_hash), (self._children, parent_hash)):
                table[key] = ev
                table.move_to_end(key)
                if len(table) > self.capacity:
                    table.popitem(last=False)

    def find(self, block_hash: BlockHash, parent_hash: BlockHash) -> Eviction | None:
        """The eviction of ``block_hash``, else of any child of ``parent_hash``, if known."""
        with self._lock:
            return self._blocks.get(block_hash) or self._children.get(parent_hash)
