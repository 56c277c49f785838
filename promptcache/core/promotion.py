"""Promotion: when the SSD tier holds a longer prefix than RAM, read it back into RAM.

RAM budget is reserved first; if it cannot be reserved the lookup stays a RAM-only hit (a
promotion failure, counted). Each file's checksum is verified as it is read; a bad block ends
the promotion there (it is quarantined by the tier).
"""

from __future__ import annotations

from typing import Protocol

from promptcache.core.block_file import CorruptBlockError
from promptcache.core.chain import chain_reach
from promptcache.core.hashing import BlockHash
from promptcache.core.ram_tier import RamTier
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_index import Row
from promptcache.core.ssd_stats import SsdStats
from promptcache.core.tree import Match


class LookupTier(Protocol):
    """A lower tier that can be searched and read back (the SSD tier)."""

    stats: SsdStats

    def find_chain(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[Row]: ...

    def read_many(self, rows: list[Row]) -> list[tuple[object, object] | CorruptBlockError]: ...

    def touch(self, rows: list[Row]) -> None: ...


def promote(
    ram: RamTier, tier: LookupTier, seq: TokenSeq, ram_match: Match, requires_checkpoint: bool
) -> int:
    """Copy the SSD continuation of ``seq`` into RAM when it beats ``ram_match``; returns the
    number of blocks promoted."""
    full = ram.tree.full_path(seq, seq.num_full_blocks)
    node, start = (full[-1] if full else None), len(full)
    rows = tier.find_chain(
        seq, start, node.block_hash if node is not None else seq.root, requires_checkpoint
    )
    if not rows or min(chain_reach(seq, rows), seq.num_tokens - 1) <= ram_match.num_tokens:
        tier.stats.add(num_misses=1)
        return 0
    parent = node if node is not None else ram.root(seq.root)
    if not ram.reserve(sum(r.payload_nbytes for r in rows), protect=parent):
        tier.stats.add(promotion_failures=1)
        ram.prune_root(seq.root)
        return 0
    promoted: list[Row] = []
    for r, result in zip(rows, tier.read_many(rows), strict=True):
        if isinstance(result, CorruptBlockError):
            break  # the hit ends before a damaged block (the tier quarantined it)
        payload, checkpoint = result
        existing = ram.get(r.block_hash)
        blk = existing or ram.insert(parent, r.meta, payload, checkpoint=checkpoint)
        if blk is None:
            break
        blk.is_seq_end = blk.is_seq_end or r.is_seq_end
        promoted.append(r)
        parent = blk
    ram.prune_root(seq.root)
    if promoted:
        tier.touch(promoted)
        tier.stats.add(num_hits=1, num_promoted_blocks=len(promoted))
    return len(promoted)
