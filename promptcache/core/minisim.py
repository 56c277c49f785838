"""Miniature simulations: one eviction policy on a hash-sampled subset of the blocks.

SHARDS-style spatial sampling (Waldspurger et al., FAST '15; miniature simulations, ATC '17):
a full block is in the sample when its chained hash falls below a threshold, so the decision is
the same for every request and every process. Because a block's hash covers its whole prefix,
two requests that share a sampled block share every sampled block before it: the sampled blocks
of each request, in order, form a valid prefix tree (the real tree contracted onto the sample).
A real ``RamTier`` with the unchanged policy code runs on that tree at 1/R of the budget, so
leaf-only eviction, pins aside, is simulated exactly as at full size, only smaller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from promptcache.core.block import Block
from promptcache.core.hashing import HASH_BYTES, BlockHash
from promptcache.core.policy import EvictionPolicy
from promptcache.core.ram_tier import RamTier

_U8 = np.dtype("u1")


def sampled_indices(hashes: Sequence[BlockHash], threshold: int) -> list[int]:
    """Indices of the hashes in the sample: last byte < ``threshold`` (of 256)."""
    if threshold >= 256:
        return list(range(len(hashes)))
    if not hashes:
        return []
    last = np.frombuffer(b"".join(hashes), dtype=_U8)[HASH_BYTES - 1 :: HASH_BYTES]
    return np.flatnonzero(last < threshold).tolist()  # type: ignore[no-any-return]


class MiniCache:
    """One policy on the sampled chains, with a budget of ``capacity_blocks`` sampled blocks.

    Each sampled block accounts ``block_bytes`` (the real block size in tokens), so the tier's
    clock, which policies use as time, advances as at full size."""

    __slots__ = ("tier", "payload", "num_hits", "num_lookups")

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int, block_bytes: int) -> None:
        self.payload = bytes(max(block_bytes, 1))  # shared by every block: sized, never read
        self.tier = RamTier(max(capacity_blocks, 1) * len(self.payload), policy)
        self.num_hits = 0
        self.num_lookups = 0

    def resize(self, capacity_blocks: int) -> None:
        """New budget; an over-full cache shrinks at the next insert."""
        self.tier.budget_bytes = max(capacity_blocks, 1) * len(self.payload)

    def _resident_prefix(self, chain: Sequence[BlockHash]) -> list[Block]:
        index = self.tier.tree.index
        # a resident block's ancestors are resident: binary search for the hit's end
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        return [index[h] for h in chain[:lo]]

    def lookup(self, chain: Sequence[BlockHash]) -> int:
        """Sampled blocks of a prompt found resident (a prefix of ``chain``), touched as hits."""
        path = self._resident_prefix(chain)
        if path:
            self.tier.touch(path, is_hit=True)
        self.num_hits += len(path)
        self.num_lookups += len(chain)
        return len(path)

    def save(self, root: BlockHash, chain: Sequence[BlockHash]) -> None:
        """Make the sampled chain resident (as far as room allows) and touch it."""
        tier = self.tier
        path = self._resident_prefix(chain)
        parent = path[-1] if path else tier.root(root)
        for h in chain[len(path) :]:
            blk = tier.insert(parent, h, h[:4], self.payload)
            if blk is None:
                break
            path.append(blk)
            parent = blk
        tier.touch(path, is_hit=False)
        tier.prune_root(root)
