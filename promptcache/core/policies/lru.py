"""Plain LRU over evictable leaves."""

from __future__ import annotations

from promptcache.core.block import Block, BlockList
from promptcache.core.policy import register_policy


class LruPolicy:
    """Least recently used leaf first. O(1) per operation except ``add_evictable`` of an old
    block (a parent whose last child was just evicted), which walks from the LRU end to its place
    by ``last_access``; such a parent is nearly always the oldest, so the walk is short."""

    name = "lru"

    def __init__(self) -> None:
        self._list = BlockList()

    def on_insert(self, block: Block) -> None:
        pass

    def on_access(self, block: Block, is_hit: bool) -> None:
        if block.policy_data is self:  # evictable: move to the MRU end
            self._list.remove(block)
            self._list.append(block)

    def add_evictable(self, block: Block) -> None:
        lst = self._list
        if lst.tail is None or block.last_access >= lst.tail.last_access:
            lst.append(block)
        else:
            anchor = lst.head
            while anchor is not None and anchor.last_access <= block.last_access:
                anchor = anchor.next
            lst.insert_before(anchor, block)
        block.policy_data = self

    def remove_evictable(self, block: Block) -> None:
        if block.policy_data is self:
            self._list.remove(block)
            block.policy_data = None

    def pop_victim(self) -> Block | None:
        block = self._list.pop_head()
        if block is not None:
            block.policy_data = None
        return block

    def admit(self, candidate: Block, victim: Block) -> bool:
        return True

    def on_evict(self, block: Block) -> None:
        self.remove_evictable(block)

    def check_integrity(self, evictable: set[int]) -> None:
        held = {id(b) for b in self._list}
        assert held == evictable, (
            f"lru holds {len(held)} blocks, tier has {len(evictable)} evictable"
        )
        assert len(self._list) == len(held)


register_policy("lru")(LruPolicy)
