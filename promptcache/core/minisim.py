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
    if len(hashes) < 128:  # numpy's call overhead dominates a short prompt
        top = max(thresholds)
        first = [i for i, h in enumerate(hashes) if h[-1] < top]
        return [first if t == top else [i for i in first if hashes[i][-1] < t] for t in thresholds]
    last = np.frombuffer(b"".join(hashes), dtype=_U8)[HASH_BYTES - 1 :: HASH_BYTES]
    return [
        list(range(len(hashes))) if t >= 256 else np.flatnonzero(last < t).tolist()
        for t in thresholds
    ]


class Census:
    """The live cache's resident bytes by their block hash's last byte: what a miniature at
    each sampling rate would hold (``RamTier`` keeps it, ``WhatIf`` reads it). A miniature
    sized by budget / block bytes / rate is off by the sample's own error (the resident set's
    sampled share is a few percent off the rate), and near a cliff (a working set just under
    the cache) a few percent decides: above_capacity at 44.8K tokens, LRU hits 0.89 in a
    full-size miniature of the budget's 700 blocks and 0.70 in one of the 679 the live cache
    holds beside its partial blocks."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * 256

    def sampled(self, threshold: int) -> int:
        """Resident bytes in blocks whose hash's last byte is below ``threshold``."""
        return sum(self.counts[:threshold])


class MiniCache:
    """One policy on the sampled chains, with room for ``capacity_blocks`` sampled blocks.

    Each sampled block accounts ``block_bytes`` (the real block's size), so the clock, which
    policies use as time, advances as at full size; ``rate``: the sample holds 1 block in it
    (``EvictionPolicy.sample_at``). Not thread-safe."""

    def __init__(
        self, policy: EvictionPolicy, capacity_blocks: int, block_bytes: int, rate: int = 1
    ) -> None:
        self.policy = policy
        policy.sample_at(rate)
        self.unit = max(block_bytes, 1)
        self.budget = max(capacity_blocks, 1) * self.unit
        self.used = 0
        self.clock = 0
        self.index: dict[BlockHash, Block] = {}
        self.roots: dict[BlockHash, Block] = {}
        self.num_hits = 0.0  # a partial block counts its fraction
        self.num_lookups = 0

    def resize(self, capacity_blocks: int) -> None:
        """New budget; an over-full cache shrinks at the next insert."""
        self.budget = max(capacity_blocks, 1) * self.unit

    def _resident_prefix(self, chain: Sequence[BlockHash]) -> list[Block]:
        index = self.index
        if chain[-1] in index:  # the common case on a warm cache: all of it
            return [index[h] for h in chain]
        # a resident block's ancestors are resident: binary search for the hit's end
        lo, hi = 0, len(chain) - 1
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

    def lookup(self, chain: Sequence[BlockHash], tail: float = 0.0) -> float:
        """Sampled blocks of a prompt found resident (a prefix of ``chain``), touched as hits.
        ``tail``: the last hash is a partial block of that fraction of a block (it counts so)."""
        self.num_lookups += len(chain)
        if not chain or chain[0] not in self.index:
            return 0
        path = self._resident_prefix(chain)
        self._touch(path, True)
        last = path[-1]
        if last.num_children == 0 and last.ref_count == 0:
            # the tier pins a hit for its request and lists its leaf again after: at the back
            # of S3-FIFO's queue (a leaf hit again and again, an exact repeat, stays for it)
            self.policy.remove_evictable(last)
            self.policy.add_evictable(last)
        got = len(path) - (1.0 - tail if tail and len(path) == len(chain) else 0.0)
        self.num_hits += got
        return got

    def save(self, root: BlockHash, chain: Sequence[BlockHash], tail: float = 0.0) -> None:
        """Make the sampled chain resident (as far as room allows) and touch it.

        The tier's rules, in fewer policy calls: the block being extended stays pinned and off
        the policy's list while room is made for its child (the tier lists it between children
        and unlists it again, which changes no decision), and each new block is listed only
        once the chain ends. The decisions are the tier's, hit for hit."""
        if not chain:
            return
        path = self._resident_prefix(chain)
        roots = self.roots
        end = path[-1] if path else roots.get(root)
        if end is None:
            end = roots[root] = Block(root, None, children=_NO_CHILDREN)
        if len(path) < len(chain):
            policy = self.policy
            if end.parent is not None and end.num_children == 0 and end.ref_count == 0:
                policy.remove_evictable(end)  # gains a child (or is pinned until the end)
            end.ref_count += 1
            index, unit, budget = self.index, self.unit, self.budget
            pop_victim, on_insert, on_evict = policy.pop_victim, policy.on_insert, policy.on_evict
            add_evictable = policy.add_evictable
            used, clock = self.used, self.clock
            last = len(chain) - 1
            for i in range(len(path), len(chain)):
                size = round(tail * unit) if tail and i == last else unit
                while used + size > budget:
                    victim = pop_victim()
                    if victim is None:
                        break
                    del index[victim.block_hash]
                    used -= victim.nbytes
                    parent = victim.parent
                    assert parent is not None
                    parent.num_children -= 1
                    on_evict(victim)
                    if parent.num_children == 0 and parent.ref_count == 0:
                        if parent.parent is None:
                            del roots[parent.block_hash]
                        else:
                            add_evictable(parent)
                else:
                    h = chain[i]
                    blk = Block(h, end, nbytes=size, children=_NO_CHILDREN, ref_count=1)
                    end.num_children += 1
                    end.ref_count -= 1
                    index[h] = blk
                    used += size
                    clock += size * TICKS_PER_BYTE
                    blk.last_access = clock
                    on_insert(blk)
                    path.append(blk)
                    end = blk
                    continue
                break  # no room could be made
            self.used, self.clock = used, clock
            end.ref_count -= 1
            if end.parent is not None and end.num_children == 0 and end.ref_count == 0:
                add_evictable(end)
        if path:
            self._touch(path, False)
        elif end.num_children == 0 and end.parent is None and end.ref_count == 0:
            del roots[root]

    def check_integrity(self) -> None:
        assert self.used == sum(b.nbytes for b in self.index.values()) <= self.budget
        children: dict[int, int] = {}
        for b in self.index.values():
            assert b.parent is not None
            p = b.parent
            assert p.block_hash in self.index or self.roots.get(p.block_hash) is p
            children[id(p)] = children.get(id(p), 0) + 1
        for b in [*self.index.values(), *self.roots.values()]:
            assert b.num_children == children.get(id(b), 0)
        self.policy.check_integrity({id(b) for b in self.index.values() if b.is_evictable})
