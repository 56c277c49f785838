"""S3-FIFO over evictable leaves: a small probation queue, a main queue and a ghost list.

New blocks enter the small queue (about 10% of the bytes). A block hit while there moves to the
main queue when it reaches the small queue's head; one never hit is evicted from there and its
hash is remembered in the ghost list, so if it comes back it goes straight to the main queue.
Main-queue blocks get one more lap per hit (up to 3) before eviction. One-off blocks, the bulk of
a busy server's traffic, therefore leave quickly without flushing the reused prefixes.
(Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023; adapted to a tree
where only leaves can leave.) Hits are read lazily from ``Block.num_hits`` when a block reaches
a queue's head, so a lookup costs O(1) however long its path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from promptcache.core.block import Block, Node, NodeList
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import register_policy

SMALL, MAIN = 0, 1
MAX_FREQ = 3


class _Meta(Node):
    __slots__ = ("queue", "freq", "hits_seen", "nbytes", "listed")

    def __init__(self, block: Block, queue: int) -> None:
        self.block = block  # Node.__init__, inlined: one per inserted block
        self.prev: Node | None = None
        self.next: Node | None = None
        self.queue = queue
        self.freq = 0
        self.hits_seen = block.num_hits  # hits after this one count towards freq
        self.nbytes = block.nbytes
        self.listed = False


class S3FifoPolicy:
    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1, ghost_factor: float = 4.0) -> None:
        self.small_fraction = small_fraction
        # the ghost remembers more hashes than are resident: reuse distances on a busy server
        # are several cache-fulls of one-off blocks (replay of the Mooncake trace: 4x > 1x)
        self.ghost_factor = ghost_factor
        self._lists = (NodeList(), NodeList())
        self._bytes = [0, 0]
        self._metas: dict[Block, _Meta] = {}
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()

    def on_insert(self, block: Block) -> None:
        queue = MAIN if self._ghost.pop(block.block_hash, 0) is None else SMALL
        self._metas[block] = _Meta(block, queue)
        self._bytes[queue] += block.nbytes

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        pass  # hits are read from Block.num_hits when a block reaches a queue's head

    def add_evictable(self, block: Block) -> None:
        meta = self._metas[block]
        lst = self._lists[meta.queue]
        tail = meta.prev = lst.tail  # NodeList.append, inlined: the hottest call
        meta.next = None
        if tail is None:
            lst.head = meta
        else:
            tail.next = meta
        lst.tail = meta
        lst.size += 1
        meta.listed = True

    def remove_evictable(self, block: Block) -> None:
        meta = self._metas.get(block)
        if meta is not None and meta.listed:
            self._lists[meta.queue].remove(meta)
            meta.listed = False

    def _move(self, meta: _Meta, queue: int) -> None:
        self._lists[meta.queue].remove(meta)
        self._bytes[meta.queue] -= meta.nbytes
        meta.queue = queue
        self._bytes[queue] += meta.nbytes
        self._lists[queue].append(meta)

    def pop_victim(self) -> Block | None:
        small, main = self._lists
        total = self._bytes[SMALL] + self._bytes[MAIN]
        while small.head is not None or main.head is not None:
            use_small = small.head is not None and (
                main.head is None or self._bytes[SMALL] >= self.small_fraction * total
            )
            meta = small.head if use_small else main.head
            assert isinstance(meta, _Meta)
            hits = meta.block.num_hits  # fold the hits since the last look into freq
            freq = meta.freq + hits - meta.hits_seen
            if freq > MAX_FREQ:
                freq = MAX_FREQ
            meta.freq, meta.hits_seen = freq, hits
            if use_small:
                if freq > 0:  # reused while on probation: promote
                    meta.freq = 0
                    self._move(meta, MAIN)
                    continue
            elif freq > 0:  # another lap in the main queue
                meta.freq -= 1
                main.remove(meta)
                main.append(meta)
                continue
            self._lists[meta.queue].remove(meta)
            meta.listed = False
            return meta.block
        return None

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def sample_at(self, rate: int) -> None:
        pass  # it learns nothing per block: its decisions need no rate

    def on_evict(self, block: Block) -> None:
        meta = self._metas.pop(block, None)
        if meta is None:
            return
        queue = meta.queue
        if meta.listed:
            self._lists[queue].remove(meta)
        self._bytes[queue] -= meta.nbytes
        if queue == SMALL:
            ghost = self._ghost
            ghost[block.block_hash] = None
            excess = len(ghost) - max(int(len(self._metas) * self.ghost_factor), 64)
            for _ in range(excess):
                ghost.popitem(last=False)

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        # no ghost from another policy's evictions: it sends every returning block straight to
        # the main queue, which locked a loop into a worse cycle than a cold start (measured);
        # for the same reason a block's earlier uses do not (held-out chat trace: -.0008)
        for b in resident:  # blocks hit before count as proven: main queue
            queue = MAIN if b.num_hits else SMALL
            self._metas[b] = _Meta(b, queue)
            self._bytes[queue] += b.nbytes
            if b.is_evictable:
                self.add_evictable(b)

    def check_integrity(self, evictable: set[int]) -> None:
        held = {id(m.block) for lst in self._lists for m in lst}
        assert held == evictable, (
            f"s3fifo holds {len(held)} leaves, tier has {len(evictable)} evictable"
        )
        assert sum(len(lst) for lst in self._lists) == len(held)
        for q, lst in enumerate(self._lists):
            for m in lst:
                assert isinstance(m, _Meta) and m.queue == q and m.listed
                assert self._metas[m.block] is m


register_policy("s3fifo")(S3FifoPolicy)
