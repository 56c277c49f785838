"""The RAM tier's own check (``RamTier.check_integrity``: tests, ``cache verify``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from promptcache.core.block import payload_nbytes

if TYPE_CHECKING:
    from promptcache.core.tiers.ram.tier import RamTier


def check_ram(tier: RamTier) -> None:
    """Raise AssertionError unless accounting, reachability, pins and policy agree."""
    index = tier.tree.index
    held = sum(b.nbytes for b in index.values())
    assert held == tier.held_bytes, f"accounted {tier.held_bytes} != held {held}"
    assert tier.reserved_bytes >= 0
    assert tier.held_bytes + tier.reserved_bytes <= tier.budget_bytes, (
        f"{tier.held_bytes} used + {tier.reserved_bytes} reserved over budget {tier.budget_bytes}"
    )
    child_counts: dict[int, int] = {}
    for blk in index.values():
        assert blk.ref_count >= 0
        assert blk.nbytes == payload_nbytes(blk.payload) + payload_nbytes(blk.checkpoint)
        parent = blk.parent
        assert parent is not None
        if parent.parent is None:
            assert tier.tree.roots.get(parent.block_hash) is parent, "orphan root"
        else:
            assert index.get(parent.block_hash) is parent, "block unreachable from its root"
        assert blk in parent.children.get(blk.first_token(), []), "missing child link"
        assert blk.depth == parent.end
        child_counts[id(parent)] = child_counts.get(id(parent), 0) + 1
    for node in list(index.values()) + list(tier.tree.roots.values()):
        assert node.num_children == child_counts.get(id(node), 0), "child count drift"
    for root in tier.tree.roots.values():
        assert root.num_children > 0 or root.ref_count > 0, "empty root kept"
    tier.policy.check_integrity({id(b) for b in index.values() if b.is_evictable})
    if tier.census is not None:
        counts = [0] * 256
        for blk in index.values():
            counts[blk.block_hash[-1]] += blk.nbytes
        assert counts == tier.census.counts, "census drift"
