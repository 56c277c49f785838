"""Deletion and expiry across every tier of a ``PromptCache`` (the caller holds its lock).

A session's blocks are those tagged with it in any tier; one is shared when any tier knows
another session on it. Shared blocks stay unless forced; what is removed goes with everything
below it in every tier (a chain is only usable from its root). Nothing removed is spilled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from promptcache.core.hashing import BlockHash, Namespace
from promptcache.core.sessions import DeleteReport, merge_session_blocks, session_key
from promptcache.core.tiers.ram import sessions as ram_sessions

if TYPE_CHECKING:
    from promptcache.core.cache import PromptCache


def delete_session(cache: PromptCache, tenant: str, session: str, force: bool) -> DeleteReport:
    key = session_key(tenant, session)
    ram = cache.ram
    maps = [ram_sessions.session_blocks(ram, key)]
    maps += [t.session_blocks(key) for t in ram.stores]
    tagged, shared = merge_session_blocks(maps)
    targets = list(tagged if force else tagged - shared)
    report = DeleteReport(shared_kept=0 if force else len(shared))
    _remove(cache, report, targets)
    # what stays (shared, or pinned) no longer counts as this session's
    ram_sessions.forget_session(ram, key)
    for tier in ram.stores:
        tier.forget_session(key)
    return report


def delete_tenant(cache: PromptCache, tenant: str) -> DeleteReport:
    """Every block of ``tenant``'s namespace, in every tier."""
    root = Namespace(cache.model_fingerprint, tenant).root_hash()
    report = DeleteReport()
    n, nbytes, kept = ram_sessions.remove_namespace(cache.ram, root)
    report.tier("ram").add(n, nbytes)
    report.pinned_kept = kept
    cache.counters.num_deleted += n
    for tier in cache.ram.stores:
        report.tier(tier.name).add(*tier.delete_namespace(root))
    cache.deletions += 1
    return report


def _remove(cache: PromptCache, report: DeleteReport, targets: list[BlockHash]) -> None:
    ram = cache.ram
    n, nbytes, kept = ram_sessions.remove_blocks(ram, targets)
    report.tier("ram").add(n, nbytes)
    report.pinned_kept = kept
    cache.counters.num_deleted += n
    for root in [h for h, r in ram.tree.roots.items() if r.num_children == 0]:
        ram.prune_root(root)
    for tier in ram.stores:
        report.tier(tier.name).add(*tier.delete_blocks(targets))
    # a promotion reading outside the lock must not bring the removed blocks back
    cache.deletions += 1


def expire(cache: PromptCache, now: float) -> dict[str, int]:
    """Blocks past their TTL in every tier; the number removed per tier."""
    ram = cache.ram
    out = {"ram": ram_sessions.expire(ram, now, cache.ram_ttl_s) if cache.ram_has_ttl else 0}
    cache.counters.num_expired += out["ram"]
    for tier in ram.stores:
        out[tier.name] = tier.expire(now)
    return out
