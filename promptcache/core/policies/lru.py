"""Plain LRU over evictable leaves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from promptcache.core.block import Block, Node, NodeList
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import register_policy


class LruPolicy:
    """Least recently used leaf first. O(1) per operation except ``add_evictable`` of an old
    block (a parent whose last child was just evicted), which walks from the LRU end to its place
    by ``last_access``; such a parent is nearly always the oldest, so the walk is short."""

    name = "lru"

    def __init__(self) -> None:
        self._list = NodeList()
        self._nodes: dict[Block, Node] = {}

    def on_insert(self, block: Block) -> None:
        pass

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        node = self._nodes.get(blocks[-1])
        if node is not None:  # evictable: move to the MRU end
            self._list.remove(node)
            self._list.append(node)

    def add_evictable(self, block: Block) -> None:
        lst = self._list
        node = Node(block)
        if lst.tail is None or block.last_access >= lst.tail.block.last_access:
            lst.append(node)
        else:
            anchor = lst.head
            while anchor is not None and anchor.block.last_access <= block.last_access:
                anchor = anchor.next
            lst.insert_before(anchor, node)
        self._nodes[block] = node

    def remove_evictable(self, block: Block) -> None:
        node = self._nodes.pop(block, None)
        if node is not None:
            self._list.remove(node)

    def pop_victim(self) -> Block | None:
        node = self._list.pop_head()
        if node is None:
            return None
        del self._nodes[node.block]
        return node.block

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def sample_at(self, rate: int) -> None:
        pass  # it learns nothing per block: its decisions need no rate

    def on_evict(self, block: Block) -> None:
        self.remove_evictable(block)

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        for b in resident:
            if b.is_evictable:
                self.add_evictable(b)  # oldest first: always an append

    def check_integrity(self, evictable: set[int]) -> None:
        held = {id(n.block) for n in self._list}
        assert held == evictable, (
            f"lru holds {len(held)} blocks, tier has {len(evictable)} evictable"
        )
        assert len(self._list) == len(held) == len(self._nodes)
        assert all(self._nodes[n.block] is n for n in self._list)


register_policy("lru")(LruPolicy)
