"""Byte-budgeted RAM tier: resident blocks, pins, eviction of leaves, spill to the next tier."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from promptcache.core.block import TICKS_PER_BYTE, Block, BlockMeta, payload_nbytes, stamp_use
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.policy import EvictionPolicy, make_policy
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import NO_USE, BlockUse
from promptcache.core.stats import Counters
from promptcache.core.tiers.base import BlockRecord, LowerTier, NullTier
from promptcache.core.tiers.ram.sessions import tag_blocks
from promptcache.core.tree import Match, PrefixTree


class CacheBudgetError(ValueError):
    """A single block (or checkpoint) is larger than the whole RAM budget."""


def as_tier_list(tiers: LowerTier | Sequence[LowerTier] | None) -> list[LowerTier]:
    """The lower tiers in order (nearest first); a lone tier or None accepted as before."""
    if tiers is None:
        return []
    if isinstance(tiers, Sequence):
        return list(tiers)
    return [tiers]


class RamTier:
    """Invariant: ``used_bytes`` == sum of resident ``nbytes``, ``used_bytes + reserved_bytes
    <= budget_bytes``; every resident block's parent is resident (or a root); the policy holds
    exactly the evictable ones. Not thread-safe: the owning cache serialises calls."""

    name = "ram"

    def __init__(
        self,
        budget_bytes: int,
        policy: EvictionPolicy | str | None = None,
        next_tier: LowerTier | Sequence[LowerTier] | None = None,
        counters: Counters | None = None,
        evictions: EvictionLog | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"RAM budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.policy = (
            policy if policy is not None and not isinstance(policy, str) else make_policy(policy)
        )
        # nearest first; never empty, so stats name a tier even without one (as before: "null")
        self.lower_tiers: list[LowerTier] = as_tier_list(next_tier) or [NullTier()]
        self._write_through = [t for t in self.lower_tiers if t.write_through]
        # the tiers that can hold anything: spilled to, asked on a RAM miss (a subclass of
        # NullTier, a test's recording tier, may hold things)
        self.stores = [t for t in self.lower_tiers if type(t) is not NullTier]
        self.counters = counters or Counters()
        self.evictions = evictions if evictions is not None else EvictionLog()
        self.tree = PrefixTree()
        self.used_bytes = 0
        self.reserved_bytes = 0  # promised to promotions loading outside the lock
        self.clock = 0
        self.wall_clock = wall_clock  # seconds, for TTL expiry (``clock`` counts bytes and uses)

    @property
    def next_tier(self) -> LowerTier:
        """The nearest lower tier (the only one before tiers became a list)."""
        return self.lower_tiers[0]

    def __len__(self) -> int:
        return len(self.tree)

    # -- reading -----------------------------------------------------------------------------

    def match(self, seq: TokenSeq, requires_checkpoint: bool = False) -> Match:
        return self.tree.match(seq, requires_checkpoint)

    def get(self, block_hash: BlockHash) -> Block | None:
        return self.tree.index.get(block_hash)

    def touch(self, blocks: tuple[Block, ...] | list[Block], is_hit: bool) -> None:
        """A chain of blocks was used (a lookup hit, or a save)."""
        if not blocks:
            return
        self.clock += 1
        now = self.clock
        self.policy.on_access(blocks, is_hit, now)
        stamp_use(blocks, now, is_hit)

    def pin(self, blocks: tuple[Block, ...] | list[Block]) -> None:
        for blk in blocks:
            if blk.ref_count == 0 and blk.num_children == 0:
                self.policy.remove_evictable(blk)
            blk.ref_count += 1

    def unpin(self, blocks: tuple[Block, ...] | list[Block]) -> None:
        for blk in blocks:
            assert blk.ref_count > 0, "unpin without pin"
            blk.ref_count -= 1
            if blk.is_evictable:
                self.policy.add_evictable(blk)

    # -- writing -----------------------------------------------------------------------------

    def insert(
        self,
        parent: Block,
        meta: BlockMeta,
        payload: Any,
        *,
        checkpoint: Any = None,
        use: BlockUse = NO_USE,
        source: LowerTier | None = None,
    ) -> Block | None:
        """Make a new block resident under ``parent`` (``meta`` chains to it); None when no
        room can be made. Raises CacheBudgetError, changing nothing, when the block alone
        exceeds the budget. ``source``: the lower tier it was read from; it is then written
        through only to the tiers below that one (which may lack it): the tiers above get it
        when RAM evicts it, so a promotion never writes a whole history to the SSD while the
        request it serves is running.
        """
        assert meta.parent_hash == parent.block_hash
        nbytes = payload_nbytes(payload) + payload_nbytes(checkpoint)
        if nbytes > self.budget_bytes:
            raise CacheBudgetError(
                f"a block of {nbytes} bytes exceeds the whole RAM budget of {self.budget_bytes} "
                "bytes; raise --ram-budget or lower --block-size"
            )
        block = Block(
            meta.block_hash, parent, meta, payload=payload, checkpoint=checkpoint, nbytes=nbytes
        )
        if not self._make_room(nbytes, protect=parent, candidate=block):
            self.counters.num_save_skipped_blocks += 1
            return None
        if parent.is_evictable:
            self.policy.remove_evictable(parent)
        self.tree.add(block)
        self.used_bytes += nbytes
        self.clock += max(nbytes, 1) * TICKS_PER_BYTE
        block.last_access = self.clock
        self.policy.on_insert(block)
        self.policy.add_evictable(block)
        tag_blocks((block,), use, self.wall_clock())
        self._write_through_put(block, source)
        return block

    def attach_checkpoint(self, block: Block, checkpoint: Any) -> bool:
        """Give a resident block a checkpoint at its end; False when no room can be made."""
        if block.checkpoint is not None:
            return True
        nbytes = payload_nbytes(checkpoint)
        if block.nbytes + nbytes > self.budget_bytes:
            raise CacheBudgetError(f"checkpoint of {nbytes} bytes does not fit the RAM budget")
        if not self._make_room(nbytes, protect=block, candidate=block):
            self.counters.num_save_skipped_blocks += 1
            return False
        block.checkpoint = checkpoint
        block.nbytes += nbytes
        self.used_bytes += nbytes
        self._write_through_put(block)
        return True

    def _write_through_put(self, block: Block, source: LowerTier | None = None) -> None:
        tiers = self._write_through
        if source is not None and source in self.lower_tiers:
            below = self.lower_tiers[self.lower_tiers.index(source) + 1 :]
            tiers = [t for t in tiers if t in below]
        if tiers:
            record = BlockRecord.from_block(block)
            for tier in tiers:
                tier.put(record)

    def reserve(self, nbytes: int, protect: Block) -> bool:
        """Evict leaves (never ``protect`` or its ancestors) until ``nbytes`` more fit, then
        hold them for the caller (``unreserve`` gives them back) so no save takes them."""
        if nbytes > self.budget_bytes or not self._make_room(
            nbytes, protect=protect, candidate=protect
        ):
            return False
        self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.reserved_bytes
        self.reserved_bytes -= nbytes

    def hold(self, block: Block) -> None:
        """Pin one block, a namespace root too, while the lock is let go (a promotion's parent)."""
        if block.parent is None:
            block.ref_count += 1
        else:
            self.pin((block,))

    def let_go(self, block: Block) -> None:
        if block.parent is None:
            assert block.ref_count > 0, "let_go without hold"
            block.ref_count -= 1
        else:
            self.unpin((block,))

    def discard(self, block: Block) -> None:
        """Drop an evictable block without spilling it (it is redundant)."""
        assert block.is_evictable
        self.policy.remove_evictable(block)
        self._remove(block)

    def root(self, root_hash: BlockHash) -> Block:
        root = self.tree.root(root_hash, create=True)
        assert root is not None
        return root

    def prune_root(self, root_hash: BlockHash) -> None:
        """Forget a namespace root that holds no blocks (safe to call any time)."""
        root = self.tree.roots.get(root_hash)
        if root is not None and root.num_children == 0 and root.ref_count == 0:
            del self.tree.roots[root_hash]

    # -- eviction ----------------------------------------------------------------------------

    def _make_room(self, nbytes: int, protect: Block, candidate: Block) -> bool:
        budget = self.budget_bytes - self.reserved_bytes
        if self.used_bytes + nbytes <= budget:
            return True
        # pin the block being extended so making room never evicts the chain being saved
        protect.ref_count += 1
        was_evictable = (
            protect.parent is not None and protect.ref_count == 1 and protect.num_children == 0
        )
        if was_evictable:
            self.policy.remove_evictable(protect)
        try:
            while self.used_bytes + nbytes > budget:
                victim = self.policy.pop_victim()
                if victim is None:
                    return False
                if not self.policy.admit(candidate, victim):
                    self.policy.add_evictable(victim)
                    return False
                self._evict(victim)
            return True
        finally:
            protect.ref_count -= 1
            if protect.is_evictable:
                self.policy.add_evictable(protect)

    def evict_bytes(self, nbytes: int) -> int:
        """Evict leaves until ``nbytes`` are freed or nothing is evictable; returns bytes freed."""
        freed = 0
        while freed < nbytes:
            victim = self.policy.pop_victim()
            if victim is None:
                break
            freed += victim.nbytes
            self._evict(victim)
        return freed

    def _evict(self, victim: Block) -> None:
        self._remove(victim)
        self.counters.num_evictions += 1
        assert victim.parent is not None
        self.evictions.note(victim.block_hash, victim.parent.block_hash, self.name)
        if self.stores:
            record = BlockRecord.from_block(victim)
            # every lower tier is offered it (a write-through tier may have dropped it before)
            if sum(tier.put(record) for tier in self.stores):
                self.counters.num_spills += 1

    def _remove(self, block: Block) -> None:
        parent = block.parent
        self.tree.remove(block)
        self.used_bytes -= block.nbytes
        self.policy.on_evict(block)
        if parent is not None and parent.is_evictable:
            self.policy.add_evictable(parent)

    # -- checks ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless accounting, reachability, pins and policy agree."""
        index = self.tree.index
        held = sum(b.nbytes for b in index.values())
        assert held == self.used_bytes, f"accounted {self.used_bytes} != held {held}"
        assert self.reserved_bytes >= 0
        assert self.used_bytes + self.reserved_bytes <= self.budget_bytes, (
            f"{self.used_bytes} used + {self.reserved_bytes} reserved over budget "
            f"{self.budget_bytes}"
        )
        child_counts: dict[int, int] = {}
        for blk in index.values():
            assert blk.ref_count >= 0
            assert blk.nbytes == payload_nbytes(blk.payload) + payload_nbytes(blk.checkpoint)
            parent = blk.parent
            assert parent is not None
            if parent.parent is None:
                assert self.tree.roots.get(parent.block_hash) is parent, "orphan root"
            else:
                assert index.get(parent.block_hash) is parent, "block unreachable from its root"
            assert blk in parent.children.get(blk.first_token(), []), "missing child link"
            assert blk.depth == parent.end
            child_counts[id(parent)] = child_counts.get(id(parent), 0) + 1
        for node in list(index.values()) + list(self.tree.roots.values()):
            assert node.num_children == child_counts.get(id(node), 0), "child count drift"
        for root in self.tree.roots.values():
            assert root.num_children > 0 or root.ref_count > 0, "empty root kept"
        self.policy.check_integrity({id(b) for b in index.values() if b.is_evictable})
