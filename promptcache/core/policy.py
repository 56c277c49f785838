"""Eviction policy interface and registry.

A tier owns residency and byte accounting; a policy only orders the evictable blocks it is told
about. Evictable means resident, unpinned and without resident children, so eviction always
takes leaves and every resident block stays reachable from its namespace root.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from promptcache.core.block import Block
from promptcache.core.hashing import BlockHash


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, block: Block) -> None:
        """A new block became resident (called once, before ``add_evictable`` for it);
        ``block.last_access`` is already set."""

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        """A lookup hit (``is_hit``) or a save used ``blocks``: a chain, each block the parent of
        the next, so only the last can be evictable. Called before the tier stamps each block
        (``last_access = now``, ``num_hits += 1`` on a hit): the old values are still readable.
        Must cost O(1), not O(len(blocks)): paths are thousands of blocks long."""

    def add_evictable(self, block: Block) -> None:
        """``block`` became evictable. Never called twice without a ``remove_evictable`` between."""

    def remove_evictable(self, block: Block) -> None:
        """``block`` stopped being evictable (pinned, gained a child, or removed by the tier)."""

    def pop_victim(self) -> Block | None:
        """Remove and return the evictable block to evict next, or None when there is none."""

    def admit(self, candidate: Block, victim: Block) -> bool:
        """Whether ``candidate`` (not yet resident) is worth evicting ``victim`` for. LRU: always."""

    def on_evict(self, block: Block) -> None:
        """``block`` left the tier; drop any per-block state (safe to call for any block once)."""

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        """Take over a tier's resident blocks on a fresh policy, as if they had been inserted
        under it; the evictable ones become evictable. ``resident``: every block, oldest
        ``last_access`` first, with the uses remembered from before it was (last) inserted (its
        hits since are ``Block.num_hits``); ``history``: recently evicted hashes, oldest first,
        with (uses, last_access). Used when the adaptive policy hands the live cache to another
        policy; what neither records (queue membership) starts afresh."""

    def sample_at(self, rate: int) -> None:
        """Run as a what-if miniature that holds 1 block in ``rate`` (``minisim``): what the
        policy learns per block it sees (frecency's reuse interval) counts ``rate`` times, so it
        learns per request at the full-size cache's pace. Call once, before the first insert."""

    def check_integrity(self, evictable: set[int]) -> None:
        """Raise AssertionError unless the policy holds exactly the blocks whose id() is given."""


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {}


def register_policy(
    name: str,
) -> Callable[[Callable[[], EvictionPolicy]], Callable[[], EvictionPolicy]]:
    def wrap(factory: Callable[[], EvictionPolicy]) -> Callable[[], EvictionPolicy]:
        _REGISTRY[name] = factory
        return factory

    return wrap


DEFAULT_POLICY = "adaptive"


def make_policy(name: str | None = None) -> EvictionPolicy:
    """A new policy by name (``None``: the default) among those registered so far (the
    built-ins: once ``promptcache.core.policies`` is imported; it re-exports this). Raises
    ValueError for an unknown name."""
    key = name or DEFAULT_POLICY
    if key not in _REGISTRY:
        raise ValueError(f"unknown eviction policy {key!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]()


def policy_names() -> list[str]:
    """The registered names (see ``make_policy``)."""
    return sorted(_REGISTRY)
