"""Sessions and expiry: who used a block, for how long it should live, and what a deletion did.

The cache stays content-addressed: a session never enters a block hash, so two sessions with the
same system prompt still share its blocks. A session is a tag beside the block (in RAM on the
block, on SSD in the index's ``sessions`` table), recorded on every block a request looks up or
saves. Tags live inside a tenant's namespace: the key of a session is ``session_key(tenant, id)``,
so one tenant can never name (or delete) another tenant's session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from promptcache.core.hashing import BlockHash

MAX_SESSION_CHARS = 256  # a client-chosen id: long enough for any UUID or user id, bounded
MAX_SESSIONS_PER_BLOCK = 64  # a shared system prompt's block keeps at most this many tags

# Anthropic's cache_control TTLs (the only two its API accepts)
TTL_HINTS = {"5m": 300.0, "1h": 3600.0}


def session_key(tenant: str, session: str) -> str:
    """The tag of ``session`` inside ``tenant``'s namespace (length-prefixed: no aliasing); an
    id longer than ``MAX_SESSION_CHARS`` is kept as its digest (bounded rows, no collisions)."""
    if len(session) > MAX_SESSION_CHARS:
        session = "sha256:" + hashlib.sha256(session.encode()).hexdigest()
    return f"{len(tenant)}:{tenant}/{session}"


def split_session_key(key: str) -> tuple[str, str]:
    """(tenant, session) of a ``session_key``; a key in no such shape (a keyed digest, under
    encryption) is returned as ("", key)."""
    size, sep, rest = key.partition(":")
    if not sep or not size.isdigit() or rest[int(size) : int(size) + 1] != "/":
        return "", key
    return rest[: int(size)], rest[int(size) + 1 :]


@dataclass(frozen=True, slots=True)
class BlockUse:
    """What a request records on the blocks it touches: its session tag (``""``: none) and its
    TTL hint in seconds (None: the tier's default)."""

    session: str = ""
    ttl_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return not self.session and self.ttl_s is None


NO_USE = BlockUse()


def longer_ttl(a: float | None, b: float | None) -> float | None:
    """The longer of two TTL hints: a block lives as long as its most patient user asked."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass(slots=True)
class TierRemoval:
    """What one tier removed: blocks and their bytes."""

    blocks: int = 0
    bytes: int = 0

    def add(self, blocks: int, nbytes: int) -> None:
        self.blocks += blocks
        self.bytes += nbytes


@dataclass(slots=True)
class DeleteReport:
    """What a deletion removed, per tier, and what it left (shared with other sessions, or
    pinned by a running request)."""

    removed: dict[str, TierRemoval] = field(default_factory=dict)
    shared_kept: int = 0  # blocks another session also uses (kept unless forced)
    pinned_kept: int = 0  # in use by a running request: kept in RAM (the tags are dropped)

    def tier(self, name: str) -> TierRemoval:
        return self.removed.setdefault(name, TierRemoval())

    def to_dict(self) -> dict[str, Any]:
        return {
            "removed_blocks": sum(r.blocks for r in self.removed.values()),
            "removed": {k: {"blocks": v.blocks, "bytes": v.bytes} for k, v in self.removed.items()},
            "shared_blocks_kept": self.shared_kept,
            "pinned_blocks_kept": self.pinned_kept,
        }


def merge_session_blocks(
    maps: Iterable[dict[BlockHash, bool]],
) -> tuple[set[BlockHash], set[BlockHash]]:
    """(every block tagged by the session in some tier, those another session uses in some
    tier). A block is shared when any tier says so: tiers may know different users of it."""
    tagged: set[BlockHash] = set()
    shared: set[BlockHash] = set()
    for m in maps:
        for h, is_shared in m.items():
            tagged.add(h)
            if is_shared:
                shared.add(h)
    return tagged, shared
