"""Frecency over evictable leaves: recency plus a log-frequency credit measured in reuse time.

A block's priority is ``t + W * ln(f)``: ``t`` the policy clock (bytes inserted so far) at its
last use, ``f`` how often it was used (insertions and hits, remembered across evictions in a
bounded history), ``W`` a few typical reuse intervals. The lowest priority leaf goes first. With
``f = 1`` this is LRU; each doubling of use buys a block ``W * ln 2`` more bytes of residence.

``W`` adapts to the workload: it tracks the geometric mean of observed reuse intervals (hits and
re-insertions of remembered hashes), so it needs no capacity or trace tuning. Times are the
tier's clock (bytes inserted), uses are read lazily from ``Block.num_hits``. Shared prefixes
and long conversations earn frequency; the one-off tails that dominate a busy server's traffic
stay at ``f = 1`` and leave first. (In the spirit of LRFU, Lee et al. 2001, and GreedyDual-
frequency; remembered counts as in TinyLFU's history.)
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from promptcache.core.block import TICKS_PER_BYTE, Block
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import register_policy

_heappush, _heappop = heapq.heappush, heapq.heappop


class ReuseGap:
    """The geometric mean of observed reuse intervals (tier clock units): an EMA of their logs.
    The adaptive policy keeps one across hand-overs, so a frecency leader starts from the
    workload's estimate rather than from its first observation, which would set it alone."""

    __slots__ = ("log_gap", "scale")

    def __init__(self) -> None:
        self.log_gap: float | None = None
        # blocks each observed one stands for: a what-if miniature's sampling rate, so that its
        # estimate moves per request as the full-size cache's does (not R times slower)
        self.scale = 1

    def observe(self, gap: int, weight: float) -> float | None:
        """Count one interval of ``weight`` (times ``scale``, at most 1/2): the new log gap,
        or None (nothing counted) when nothing was inserted in between."""
        if gap < TICKS_PER_BYTE:
            return None
        x = math.log(gap)
        weight = min(weight * self.scale, 0.5)
        lg = self.log_gap
        lg = self.log_gap = x if lg is None else (1 - weight) * lg + weight * x
        return lg

    def observe_hit(self, blocks: Sequence[Block], now: int) -> float | None:
        """A hit on ``blocks`` at ``now``, before their last use is stamped. Every hit block's
        interval counts, but in O(1): the blocks after the point where a chain leaves the shared
        prefix were last used together, so the deepest block's stands for the chain, weighted
        by its length."""
        return self.observe(now - blocks[-1].last_access, 0.001 * len(blocks))

    def observe_return(self, block: Block, last_use: int) -> float | None:
        """A remembered hash inserted again, last used at ``last_use``."""
        return self.observe(block.last_access - last_use, 0.001)


class _Meta:
    __slots__ = ("base_freq", "entry")

    def __init__(self, base_freq: int) -> None:
        self.base_freq = base_freq  # 1 + uses remembered from before; hits add Block.num_hits
        self.entry: list[object] | None = None  # the block's live heap entry while evictable


class FrecencyPolicy:
    name = "frecency"

    def __init__(self, reuse_windows: float = 4.0, history_factor: float = 8.0) -> None:
        self.reuse_windows = reuse_windows
        # history holds this many times the resident block count: reuse intervals on a busy
        # server span several cache-fulls
        self.history_factor = history_factor
        self._reuse = ReuseGap()
        self._window = 0.0  # window_bytes, recomputed when the reuse gap moves
        self._heap: list[list[object]] = []
        self._num_listed = 0
        self._metas: dict[Block, _Meta] = {}
        self._seq = 0
        self._history: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()

    @property
    def window_bytes(self) -> float:
        return self._window

    def _set_window(self, log_gap: float | None) -> None:
        if log_gap is not None:
            self._window = self.reuse_windows * math.exp(log_gap)

    def sample_at(self, rate: int) -> None:
        self._reuse.scale = rate

    def share_reuse(self, reuse: ReuseGap) -> None:
        """Measure reuse intervals into ``reuse`` from now on, starting from its estimate
        (``AdaptivePolicy`` keeps it across hand-overs)."""
        self._reuse = reuse
        self._set_window(reuse.log_gap)

    def _priority(self, block: Block, last: int, freq: int) -> float:
        """Lowest goes first; fixed until the block is next used (subclasses may override)."""
        return last + self._window * math.log(freq) if freq > 1 else last

    def _push(self, block: Block, meta: _Meta, priority: float) -> None:
        seq = self._seq = self._seq + 1
        entry = meta.entry = [priority, seq, block]
        heap = self._heap
        _heappush(heap, entry)
        if len(heap) > 2 * self._num_listed + 64:  # drop stale entries
            self._heap = [e for e in heap if e[2] is not None]
            heapq.heapify(self._heap)

    def _unlist(self, meta: _Meta) -> None:
        if meta.entry is not None:
            meta.entry[2] = None  # stale: skipped when it reaches the top
            meta.entry = None
            self._num_listed -= 1

    def _seed_uses(self, block: Block) -> int:
        """Uses a block (re)inserted starts with: 1, plus what the history remembers of it."""
        base = 1
        seen = self._history.pop(block.block_hash, None)
        if seen is not None:
            base += seen[0]
            self._set_window(self._reuse.observe_return(block, seen[1]))
        return base

    def on_insert(self, block: Block) -> None:
        self._metas[block] = _Meta(self._seed_uses(block))

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        block = blocks[-1]
        if is_hit:
            self._set_window(self._reuse.observe_hit(blocks, now))
        meta = self._metas.get(block)
        if meta is not None and meta.entry is not None:
            self._unlist(meta)
            self._num_listed += 1
            freq = meta.base_freq + block.num_hits + is_hit
            self._push(block, meta, self._priority(block, now, freq))

    def add_evictable(self, block: Block) -> None:
        meta = self._metas[block]
        self._num_listed += 1
        freq = meta.base_freq + block.num_hits
        self._push(block, meta, self._priority(block, block.last_access, freq))

    def remove_evictable(self, block: Block) -> None:
        meta = self._metas.get(block)
        if meta is not None and meta.entry is not None:  # _unlist, inlined
            meta.entry[2] = None
            meta.entry = None
            self._num_listed -= 1

    def pop_victim(self) -> Block | None:
        heap = self._heap
        while heap:
            entry = _heappop(heap)
            block = entry[2]
            if block is None:
                continue
            assert isinstance(block, Block)
            self._metas[block].entry = None
            self._num_listed -= 1
            return block
        return None

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def on_evict(self, block: Block) -> None:
        meta = self._metas.pop(block, None)
        if meta is None:
            return
        self._unlist(meta)
        history = self._history
        history[block.block_hash] = (meta.base_freq + block.num_hits, block.last_access)
        limit = int(len(self._metas) * self.history_factor)
        while len(history) > limit and len(history) > 64:
            history.popitem(last=False)

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        self._history = OrderedDict(history)
        for b, uses in resident.items():
            self._metas[b] = _Meta(1 + uses)
            if b.is_evictable:
                self.add_evictable(b)

    def hand_over_state(
        self,
    ) -> tuple[dict[Block, int], dict[BlockHash, tuple[int, int]]]:
        """For ``AdaptivePolicy`` handing the tier to another policy: every resident block with
        its uses remembered from before it was inserted, and the history of evicted hashes,
        oldest first: (uses, last use)."""
        resident = {b: meta.base_freq - 1 for b, meta in self._metas.items()}
        return resident, dict(self._history)

    def check_integrity(self, evictable: set[int]) -> None:
        live = [e[2] for e in self._heap if e[2] is not None]
        held = {id(b) for b in live}
        assert held == evictable, (
            f"frecency holds {len(held)} leaves, tier has {len(evictable)} evictable"
        )
        assert len(live) == len(held) == self._num_listed
        for b in live:
            assert isinstance(b, Block)
            entry = self._metas[b].entry
            assert entry is not None and entry[2] is b


register_policy("frecency")(FrecencyPolicy)
