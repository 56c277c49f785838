"""Sessions, deletion and expiry in the RAM tier (functions over a ``RamTier``; the cache's lock
is held by the caller).

Removal never spills to a lower tier (the point is that the data goes) and never touches a
pinned block: a running request still reads it. A pinned block (or one with a pinned block
below it) stays and is reported; its session tag is dropped so it no longer counts as the
session's, and it goes the ordinary way (eviction, expiry) once released.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from promptcache.core.block import Block
from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK, BlockUse, longer_ttl

if TYPE_CHECKING:
    from promptcache.core.tiers.ram.tier import RamTier


def tag_blocks(blocks: Iterable[Block], use: BlockUse, now: float) -> None:
    for blk in blocks:
        blk.used_at = now
        if use.ttl_s is not None:
            blk.ttl_s = longer_ttl(blk.ttl_s, use.ttl_s)
        if use.session:
            if blk.sessions is None:
                blk.sessions = {use.session}
            elif use.session not in blk.sessions and len(blk.sessions) < MAX_SESSIONS_PER_BLOCK:
                # past the bound a block counts as shared anyway: no deletion takes it unforced
                blk.sessions.add(use.session)


def session_blocks(ram: RamTier, session: str) -> dict[BlockHash, bool]:
    return {
        blk.block_hash: len(blk.sessions) > 1
        for blk in ram.tree.index.values()
        if blk.sessions and session in blk.sessions
    }


def forget_session(ram: RamTier, session: str) -> None:
    for blk in ram.tree.index.values():
        if blk.sessions and session in blk.sessions:
            blk.sessions.discard(session)


def _subtree(block: Block) -> list[Block]:
    """``block`` and every block below it, parents before children."""
    out, stack = [], [block]
    while stack:
        blk = stack.pop()
        out.append(blk)
        for kids in blk.children.values():
            stack.extend(kids)
    return out


def remove_blocks(ram: RamTier, hashes: Iterable[BlockHash]) -> tuple[int, int, int]:
    """Remove these blocks and what hangs below them, leaves first; (removed, bytes, pinned
    kept). Blocks on the path of a pinned block stay."""
    removed = nbytes = kept = 0
    found: dict[int, Block] = {}
    for h in hashes:
        top = ram.tree.index.get(h)
        if top is not None and id(top) not in found:
            found.update((id(b), b) for b in _subtree(top))
    # deepest first: each block is a leaf when its turn comes (unless a pinned one is below)
    for blk in sorted(found.values(), key=lambda b: -b.depth):
        if blk.is_evictable:
            nbytes += blk.nbytes
            ram.discard(blk)
            removed += 1
        else:
            kept += 1
    return removed, nbytes, kept


def remove_namespace(ram: RamTier, root: BlockHash) -> tuple[int, int, int]:
    node = ram.tree.roots.get(root)
    if node is None:
        return 0, 0, 0
    tops = [b.block_hash for kids in node.children.values() for b in kids]
    out = remove_blocks(ram, tops)
    ram.prune_root(root)
    return out


def expire(ram: RamTier, now: float, default_ttl: float | None) -> int:
    """Remove evictable blocks unused for longer than their TTL (the block's hint, else
    ``default_ttl``); a parent that becomes a leaf is checked again. Returns the count."""

    def expired(blk: Block) -> bool:
        ttl = blk.ttl_s if blk.ttl_s is not None else default_ttl
        return ttl is not None and now - blk.used_at > ttl

    stale = [b for b in ram.tree.index.values() if expired(b)]
    # deepest first, so a stale parent is a leaf by the time its turn comes
    stale.sort(key=lambda b: -b.depth)
    n = 0
    for blk in stale:
        if blk.is_evictable and ram.tree.index.get(blk.block_hash) is blk:
            parent = blk.parent
            ram.discard(blk)
            n += 1
            if parent is not None and parent.parent is None:
                ram.prune_root(parent.block_hash)
    return n
