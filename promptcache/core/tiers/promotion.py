"""Promotion: when a lower tier holds a longer prefix than RAM, read it back into RAM.

Three steps, so slow reads never hold the cache's lock: ``plan`` (under the lock) asks every
lower tier, picks the one that extends furthest, reserves RAM for its blocks and pins the RAM
block they hang from; ``load`` (outside the lock) reads them; ``finish`` (under the lock) gives
the reservation back and inserts what was read, in order, up to the first unusable block.
When RAM cannot be reserved the lookup stays a RAM-only hit (counted by the tier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from promptcache.core.block import Block
from promptcache.core.block_file import CorruptBlockError
from promptcache.core.chain import chain_reach
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import BlockStore, LookupFeedback, ReadResult, StoredBlock
from promptcache.core.tiers.ram.tier import CacheBudgetError, RamTier
from promptcache.core.tree import Match


@dataclass(slots=True)
class PromotionPlan:
    """A promotion between its steps: while it lives, ``parent`` is pinned and ``reserved``
    bytes of RAM are held for it."""

    tier: BlockStore
    blocks: list[StoredBlock]
    parent: Block
    reserved: int
    root: BlockHash  # the namespace, pruned once the plan is done if it stayed empty
    num_deletions: int  # the stack's deletions when planned: one since, and nothing is inserted


class Promoted(NamedTuple):
    num_blocks: int
    num_damaged: int  # blocks that failed their checks (quarantined by their tier)


def plan(
    ram: RamTier,
    tiers: Sequence[BlockStore],
    seq: TokenSeq,
    ram_match: Match,
    requires_checkpoint: bool,
    num_deletions: int = 0,
) -> PromotionPlan | None:
    """Under the cache's lock: the longest continuation of ``seq`` in ``tiers`` (nearest
    first) if it beats ``ram_match``, with its RAM reserved and its parent pinned; None
    otherwise."""
    full = ram.full_path(seq, seq.num_full_blocks)
    node, start = (full[-1] if full else None), len(full)
    parent_hash = node.block_hash if node is not None else seq.root
    best: tuple[int, BlockStore, list[StoredBlock]] | None = None
    asked: list[BlockStore] = []
    for tier in tiers:
        found = tier.lookup(seq, start, parent_hash, requires_checkpoint)
        asked.append(tier)
        reach = min(chain_reach(seq, found), seq.num_tokens - 1)
        if found and reach > ram_match.num_tokens and (best is None or reach > best[0]):
            best = (reach, tier, found)
    for tier in asked:
        if (best is None or tier is not best[1]) and isinstance(tier, LookupFeedback):
            tier.note_miss(failed=False)
    if best is None:
        return None
    _, tier, blocks = best
    parent = node if node is not None else ram.root(seq.root)
    nbytes = sum(b.nbytes for b in blocks)
    if not ram.reserve(nbytes, protect=parent):
        if isinstance(tier, LookupFeedback):
            tier.note_miss(failed=True)
        ram.prune_root(seq.root)
        return None
    ram.hold(parent)
    return PromotionPlan(tier, blocks, parent, nbytes, seq.root, num_deletions)


def load(p: PromotionPlan) -> list[ReadResult]:
    """Outside the lock: the planned blocks as read (verified) by their tier."""
    return p.tier.read(p.blocks)


def finish(ram: RamTier, p: PromotionPlan, loaded: list[ReadResult] | None) -> Promoted:
    """Under the lock again: release the plan and insert what was loaded (None: nothing, the
    load failed)."""
    ram.unreserve(p.reserved)
    ram.let_go(p.parent)
    parent = p.parent
    promoted = []
    num_damaged = 0
    for b, result in zip(p.blocks, loaded or (), strict=False):
        if isinstance(result, Exception):
            # the hit ends before an unusable block (a damaged one is quarantined)
            num_damaged = int(isinstance(result, CorruptBlockError) and result.is_damage)
            break
        payload, checkpoint = result
        # another request may have saved or promoted it meanwhile
        blk = ram.get(b.block_hash) or ram.insert(
            parent, b.meta, payload, checkpoint=checkpoint, source=p.tier
        )
        if blk is None:
            break
        blk.is_seq_end = blk.is_seq_end or b.is_seq_end
        promoted.append(b.block_hash)
        parent = blk
    ram.prune_root(p.root)
    if promoted and isinstance(p.tier, LookupFeedback):
        p.tier.touch(promoted)
    return Promoted(len(promoted), num_damaged)


def insert_warm(
    ram: RamTier,
    blocks: list[StoredBlock],
    loaded: list[ReadResult],
    source: BlockStore | None = None,
) -> int:
    """Under the cache's lock: insert warm-up blocks read from a lower tier (parent before
    child) whose parent is resident, never past the RAM budget; an unusable block is skipped
    with its descendants. Returns the number inserted."""
    inserted = 0
    roots = set()
    for b, result in zip(blocks, loaded, strict=True):
        m = b.meta
        if isinstance(result, Exception) or ram.get(m.block_hash) is not None:
            continue
        if m.depth == 0:
            roots.add(m.root)
            parent: Block | None = ram.root(m.root)
        else:
            parent = ram.get(m.parent_hash)
        if parent is None:
            continue  # its parent was unusable
        payload, checkpoint = result
        try:
            blk = ram.insert(parent, m, payload, checkpoint=checkpoint, source=source)
        except CacheBudgetError:
            blk = None
        if blk is None:
            break  # RAM is full
        blk.is_seq_end = b.is_seq_end
        inserted += 1
    for root in roots:
        ram.prune_root(root)
    return inserted
