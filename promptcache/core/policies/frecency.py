"""Frecency over evictable leaves: recency plus a log-frequency credit measured in reuse time.

A block's priority is ``t + W * ln(f)``: ``t`` the policy clock (bytes inserted so far) at its
last use, ``f`` how often it was used (insertions and hits, remembered across evictions in a
bounded history), ``W`` a few typical reuse intervals. The lowest priority leaf goes first. With
``f = 1`` this is LRU; each doubling of use buys a block ``W * ln 2`` more bytes of residence.

``W`` adapts to the workload: it tracks the geometric mean of observed reuse intervals (hits and
re-insertions of remembered hashes), so it needs no capacity or trace tuning. Shared prefixes
and long conversations earn frequency; the one-off tails that dominate a busy server's traffic
stay at ``f = 1`` and leave first. (In the spirit of LRFU, Lee et al. 2001, and GreedyDual-
frequency; remembered counts as in TinyLFU's history.)
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from promptcache.core.block import Block
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import register_policy


class _Meta:
    __slots__ = ("freq", "last", "entry")

    def __init__(self, freq: int, last: int) -> None:
        self.freq = freq
        self.last = last
        self.entry: list[object] | None = None  # the block's live heap entry while evictable


class FrecencyPolicy:
    name = "frecency"

    def __init__(self, reuse_windows: float = 4.0, history_factor: float = 8.0) -> None:
        self.reuse_windows = reuse_windows
        # history holds this many times the resident block count: reuse intervals on a busy
        # server span several cache-fulls
        self.history_factor = history_factor
        self._clock = 0
        self._log_gap: float | None = None  # EMA of ln(reuse interval in bytes)
        self._heap: list[list[object]] = []
        self._num_listed = 0
        self._num_blocks = 0
        self._seq = 0
        self._history: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()

    @property
    def window_bytes(self) -> float:
        return 0.0 if self._log_gap is None else self.reuse_windows * math.exp(self._log_gap)

    def _observe(self, last: int) -> None:
        gap = self._clock - last
        if gap > 0:
            x = math.log(gap)
            self._log_gap = x if self._log_gap is None else 0.999 * self._log_gap + 0.001 * x

    def _priority(self, block: Block, meta: _Meta) -> float:
        """Lowest goes first; fixed until the block is next used (subclasses may override)."""
        return meta.last + self.window_bytes * math.log(meta.freq)

    def _push(self, block: Block, meta: _Meta) -> None:
        self._seq += 1
        meta.entry = [self._priority(block, meta), self._seq, block]
        heapq.heappush(self._heap, meta.entry)
        if len(self._heap) > 2 * self._num_listed + 64:  # drop stale entries
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def _unlist(self, meta: _Meta) -> None:
        if meta.entry is not None:
            meta.entry[2] = None  # stale: skipped when it reaches the top
            meta.entry = None
            self._num_listed -= 1

    def on_insert(self, block: Block) -> None:
        self._clock += max(block.nbytes, 1)
        freq = 1
        seen = self._history.pop(block.block_hash, None)
        if seen is not None:
            freq += seen[0]
            self._observe(seen[1])
        block.policy_data = _Meta(freq, self._clock)
        self._num_blocks += 1

    def on_access(self, block: Block, is_hit: bool) -> None:
        meta: _Meta | None = block.policy_data
        if meta is None:
            return
        if is_hit:
            self._observe(meta.last)
            meta.freq += 1
        meta.last = self._clock
        if meta.entry is not None:
            self._unlist(meta)
            self._num_listed += 1
            self._push(block, meta)

    def add_evictable(self, block: Block) -> None:
        meta: _Meta = block.policy_data
        self._num_listed += 1
        self._push(block, meta)

    def remove_evictable(self, block: Block) -> None:
        meta: _Meta | None = block.policy_data
        if meta is not None:
            self._unlist(meta)

    def pop_victim(self) -> Block | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            block = entry[2]
            if block is None:
                continue
            assert isinstance(block, Block)
            meta: _Meta = block.policy_data
            meta.entry = None
            self._num_listed -= 1
            return block
        return None

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def on_evict(self, block: Block) -> None:
        meta: _Meta | None = block.policy_data
        if meta is None:
            return
        self._unlist(meta)
        self._num_blocks -= 1
        self._history[block.block_hash] = (meta.freq, meta.last)
        while len(self._history) > max(int(self._num_blocks * self.history_factor), 64):
            self._history.popitem(last=False)
        block.policy_data = None

    def check_integrity(self, evictable: set[int]) -> None:
        live = [e[2] for e in self._heap if e[2] is not None]
        held = {id(b) for b in live}
        assert held == evictable, (
            f"frecency holds {len(held)} leaves, tier has {len(evictable)} evictable"
        )
        assert len(live) == len(held) == self._num_listed
        for b in live:
            assert isinstance(b, Block) and b.policy_data.entry is not None
            assert b.policy_data.entry[2] is b


register_policy("frecency")(FrecencyPolicy)
