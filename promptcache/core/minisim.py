"""Miniature simulations: one eviction policy on a hash-sampled subset of the blocks.

SHARDS-style spatial sampling (Waldspurger et al., FAST '15; miniature simulations, ATC '17):
a full block is in the sample when its chained hash falls below a threshold, so the decision is
the same for every request and every process. Because a block's hash covers its whole prefix,
two requests that share a sampled block share every sampled block before it: the sampled blocks
of each request, in order, form a valid prefix tree (the real tree contracted onto the sample).
``MiniCache`` runs the unchanged policy code on that tree at 1/R of the budget, with the tier's
rules (leaf-only eviction, the chain being saved kept, the clock in bytes inserted), only
without payloads, token checks or a next tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from promptcache.core.block import TICKS_PER_BYTE, Block, stamp_use
from promptcache.core.hashing import HASH_BYTES, BlockHash
from promptcache.core.policy import EvictionPolicy

_U8 = np.dtype("u1")
_NO_CHILDREN: dict[int, list[Block]] = {}  # a miniature counts children, it never lists them


def sampled_indices(hashes: Sequence[BlockHash], thresholds: Sequence[int]) -> list[list[int]]:
    """Per threshold, the indices of the hashes in that sample: last byte < threshold (of 256).
    A lower threshold's sample is a subset of a higher one's."""
    if not hashes:
        return [[] for _ in thresholds]
    last = np.frombuffer(b"".join(hashes), dtype=_U8)[HASH_BYTES - 1 :: HASH_BYTES]
    return [
        list(range(len(hashes))) if t >= 256 else np.flatnonzero(last < t).tolist()
        for t in thresholds
    ]


class MiniCache:
    """One policy on the sampled chains, with room for ``capacity_blocks`` sampled blocks.

    Each sampled block accounts ``block_bytes`` (the real block's size), so the clock, which
    policies use as time, advances as at full size. Not thread-safe."""

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int, block_bytes: int) -> None:
        self.policy = policy
        self.unit = max(block_bytes, 1)
        self.budget = max(capacity_blocks, 1) * self.unit
        self.used = 0
        self.clock = 0
        self.index: dict[BlockHash, Block] = {}
        self.roots: dict[BlockHash, Block] = {}
        self.num_hits = 0
        self.num_lookups = 0

    def resize(self, capacity_blocks: int) -> None:
        """New budget; an over-full cache shrinks at the next insert."""
        self.budget = max(capacity_blocks, 1) * self.unit

    def _resident_prefix(self, chain: Sequence[BlockHash]) -> list[Block]:
        index = self.index
        # a resident block's ancestors are resident: binary search for the hit's end
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        return [index[h] for h in chain[:lo]]

    def _touch(self, blocks: list[Block], is_hit: bool) -> None:
        self.clock += 1
        now = self.clock
        self.policy.on_access(blocks, is_hit, now)
        stamp_use(blocks, now, is_hit)

    def lookup(self, chain: Sequence[BlockHash]) -> int:
        """Sampled blocks of a prompt found resident (a prefix of ``chain``), touched as hits."""
        path = self._resident_prefix(chain)
        if path:
            self._touch(path, True)
        self.num_hits += len(path)
        self.num_lookups += len(chain)
        return len(path)

    def save(self, root: BlockHash, chain: Sequence[BlockHash]) -> None:
        """Make the sampled chain resident (as far as room allows) and touch it."""
        if not chain:
            return
        path = self._resident_prefix(chain)
        parent = path[-1] if path else self.roots.get(root)
        if parent is None:
            parent = self.roots[root] = Block(root, None, children=_NO_CHILDREN)
        for h in chain[len(path) :]:
            if self.used + self.unit > self.budget and not self._make_room(parent):
                break
            parent = self._insert(parent, h)
            path.append(parent)
        if path:
            self._touch(path, False)
        elif parent.num_children == 0 and parent.parent is None:
            del self.roots[root]

    def _insert(self, parent: Block, h: BlockHash) -> Block:
        policy = self.policy
        if parent.parent is not None and parent.num_children == 0 and parent.ref_count == 0:
            policy.remove_evictable(parent)  # no longer a leaf
        blk = Block(h, parent, nbytes=self.unit, children=_NO_CHILDREN)
        parent.num_children += 1
        self.index[h] = blk
        self.used += self.unit
        self.clock += self.unit * TICKS_PER_BYTE
        blk.last_access = self.clock
        policy.on_insert(blk)
        policy.add_evictable(blk)
        return blk

    def _make_room(self, keep: Block) -> bool:
        """Evict leaves until one more block fits, never ``keep`` (the chain being saved)."""
        policy = self.policy
        was_leaf = keep.is_evictable
        keep.ref_count += 1
        if was_leaf:
            policy.remove_evictable(keep)
        while self.used + self.unit > self.budget:
            victim = policy.pop_victim()
            if victim is None:
                break
            self._evict(victim)
        keep.ref_count -= 1
        if was_leaf:
            policy.add_evictable(keep)
        return self.used + self.unit <= self.budget

    def _evict(self, victim: Block) -> None:
        del self.index[victim.block_hash]
        self.used -= victim.nbytes
        parent = victim.parent
        assert parent is not None
        parent.num_children -= 1
        self.policy.on_evict(victim)
        if parent.parent is None:
            if parent.num_children == 0 and parent.ref_count == 0:
                del self.roots[parent.block_hash]
        elif parent.is_evictable:
            self.policy.add_evictable(parent)

    def check_integrity(self) -> None:
        assert self.used == len(self.index) * self.unit <= self.budget
        children: dict[int, int] = {}
        for b in self.index.values():
            assert b.parent is not None
            p = b.parent
            assert p.block_hash in self.index or self.roots.get(p.block_hash) is p
            children[id(p)] = children.get(id(p), 0) + 1
        for b in [*self.index.values(), *self.roots.values()]:
            assert b.num_children == children.get(id(b), 0)
        self.policy.check_integrity({id(b) for b in self.index.values() if b.is_evictable})
