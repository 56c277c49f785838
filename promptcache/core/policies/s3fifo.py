"""S3-FIFO over evictable leaves: a small probation queue, a main queue and a ghost list.

New blocks enter the small queue (about 10% of the bytes). A block hit while there moves to the
main queue when it reaches the small queue's head; one never hit is evicted from there and its
hash is remembered in the ghost list, so if it comes back it goes straight to the main queue.
Main-queue blocks get one more lap per hit (up to 3) before eviction. One-off blocks, the bulk of
a busy server's traffic, therefore leave quickly without flushing the reused prefixes.
(Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023; adapted to a tree
where only leaves can leave.)
"""

from __future__ import annotations

from collections import OrderedDict

from promptcache.core.block import Block, BlockList
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import register_policy

SMALL, MAIN = 0, 1
MAX_FREQ = 3


class _Meta:
    __slots__ = ("queue", "freq", "nbytes", "listed")

    def __init__(self, queue: int, nbytes: int) -> None:
        self.queue = queue
        self.freq = 0
        self.nbytes = nbytes
        self.listed = False


class S3FifoPolicy:
    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1, ghost_factor: float = 4.0) -> None:
        self.small_fraction = small_fraction
        # the ghost remembers more hashes than are resident: reuse distances on a busy server
        # are several cache-fulls of one-off blocks (replay of the Mooncake trace: 4x > 1x)
        self.ghost_factor = ghost_factor
        self._lists = (BlockList(), BlockList())
        self._bytes = [0, 0]
        self._num_blocks = 0
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()

    def on_insert(self, block: Block) -> None:
        queue = MAIN if self._ghost.pop(block.block_hash, 0) is None else SMALL
        block.policy_data = _Meta(queue, block.nbytes)
        self._bytes[queue] += block.nbytes
        self._num_blocks += 1

    def on_access(self, block: Block, is_hit: bool) -> None:
        meta = block.policy_data
        if is_hit and meta is not None:
            meta.freq = min(meta.freq + 1, MAX_FREQ)

    def add_evictable(self, block: Block) -> None:
        meta: _Meta = block.policy_data
        self._lists[meta.queue].append(block)
        meta.listed = True

    def remove_evictable(self, block: Block) -> None:
        meta: _Meta | None = block.policy_data
        if meta is not None and meta.listed:
            self._lists[meta.queue].remove(block)
            meta.listed = False

    def _move(self, block: Block, queue: int) -> None:
        meta: _Meta = block.policy_data
        self._lists[meta.queue].remove(block)
        self._bytes[meta.queue] -= meta.nbytes
        meta.queue = queue
        self._bytes[queue] += meta.nbytes
        self._lists[queue].append(block)

    def pop_victim(self) -> Block | None:
        small, main = self._lists
        total = self._bytes[SMALL] + self._bytes[MAIN]
        while small.head is not None or main.head is not None:
            use_small = small.head is not None and (
                main.head is None or self._bytes[SMALL] >= self.small_fraction * total
            )
            block = small.head if use_small else main.head
            assert block is not None
            meta: _Meta = block.policy_data
            if use_small:
                if meta.freq > 0:  # reused while on probation: promote
                    meta.freq = 0
                    self._move(block, MAIN)
                    continue
            elif meta.freq > 0:  # another lap in the main queue
                meta.freq -= 1
                main.remove(block)
                main.append(block)
                continue
            self._lists[meta.queue].remove(block)
            meta.listed = False
            return block
        return None

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def on_evict(self, block: Block) -> None:
        meta: _Meta | None = block.policy_data
        if meta is None:
            return
        if meta.listed:
            self._lists[meta.queue].remove(block)
        self._bytes[meta.queue] -= meta.nbytes
        self._num_blocks -= 1
        if meta.queue == SMALL:
            self._ghost[block.block_hash] = None
            while len(self._ghost) > max(int(self._num_blocks * self.ghost_factor), 64):
                self._ghost.popitem(last=False)
        block.policy_data = None

    def check_integrity(self, evictable: set[int]) -> None:
        held = {id(b) for lst in self._lists for b in lst}
        assert held == evictable, (
            f"s3fifo holds {len(held)} leaves, tier has {len(evictable)} evictable"
        )
        assert sum(len(lst) for lst in self._lists) == len(held)
        for q, lst in enumerate(self._lists):
            for b in lst:
                assert b.policy_data.queue == q and b.policy_data.listed


register_policy("s3fifo")(S3FifoPolicy)
