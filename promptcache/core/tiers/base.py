"""The tiers behind RAM: their protocols by role (reads, writes, admin), what passes between
them, the null tier and the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from promptcache.core.block import Block, BlockMeta
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import BlockUse


class BlockRecord(NamedTuple):
    """A block as it leaves a tier: its identity plus this copy's data and state."""

    meta: BlockMeta
    payload: Any
    checkpoint: Any
    nbytes: int  # payload + checkpoint bytes
    is_seq_end: bool
    # the sessions that used it and its TTL hint, so a write-through copy carries its tags
    sessions: frozenset[str] = frozenset()
    ttl_s: float | None = None

    @property
    def block_hash(self) -> BlockHash:
        return self.meta.block_hash

    @classmethod
    def from_block(cls, block: Block) -> BlockRecord:
        assert block.parent is not None
        return cls(
            block.meta, block.payload, block.checkpoint, block.nbytes, block.is_seq_end,
            frozenset(block.sessions or ()), block.ttl_s,
        )  # fmt: skip


class StoredBlock(NamedTuple):
    """What a lower tier knows of a block it holds, before reading it: enough to walk the
    chain (``chain.ChainEntry``) and to reserve RAM for it."""

    meta: BlockMeta
    nbytes: int  # payload + checkpoint bytes once read back
    has_checkpoint: bool
    is_seq_end: bool

    @property
    def block_hash(self) -> BlockHash:
        return self.meta.block_hash


# what ``read`` gives per block: (payload, checkpoint), or the exception that ended it
ReadResult = tuple[Any, Any] | Exception


class TierReads(Protocol):
    """How a lookup reads a tier: find a continuation under the cache's lock, read it outside.

    Calls may come from several request threads at once (under the cache's lock for all but
    ``read``, which runs outside it)."""

    name: str

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool
    ) -> list[StoredBlock]:
        """Blocks continuing ``seq`` after full block ``start - 1`` (hash ``parent``), found by
        the shared walk (``chain``): whole blocks, then the best partial one; with
        ``requires_checkpoint`` only up to the deepest checkpoint a hit could end on."""

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        """Each block's (payload, checkpoint), verified, or the exception that makes it
        unusable (damaged: the tier quarantines it; gone since the lookup: nothing is wrong).
        Called outside the cache's lock; slow I/O belongs here."""

    def touch(self, hashes: list[BlockHash]) -> None:
        """These blocks were promoted to RAM (a hit of this tier): count it, refresh recency."""

    def note_miss(self, failed: bool) -> None:
        """A lookup asked this tier and promoted nothing from it: its continuation was not the
        longest (``failed`` False), or RAM had no room for it (``failed`` True)."""


class TierWrites(Protocol):
    """How blocks reach a tier: RAM's evictions (spill) and, when ``write_through``, every new
    block. A tier must never block a request on its writes."""

    write_through: bool  # True: the stack also puts every new block, not only evicted ones

    def put(self, record: BlockRecord) -> bool:
        """Accept a block (evicted, or new when ``write_through``). Must not block the caller:
        it may queue the write or drop the block (returning False). Putting the same hash twice
        is harmless."""

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done; False on timeout."""


class TierAdmin(Protocol):
    """Sessions, deletion, expiry, stats and checks: the same in every tier (RAM included), so
    the stack fans each operation out to every tier alike."""

    name: str

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        """A namespace root is in use by ``tenant`` (for names on disk; may be ignored)."""

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        """A request used these blocks (a hit, or a save): record ``use.session`` (unless empty)
        and the TTL hint (the longer one wins) on those this tier holds, and count ``now`` as
        their last use. Blocks it does not hold (yet) are ignored: a block still being written
        carries its tags in its ``BlockRecord``. ``root`` is their namespace (all share it), for
        tiers keyed by namespace. Must be cheap: called on the request path."""

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        """Blocks this tier holds tagged with ``session`` -> whether another session uses it
        too (as far as this tier knows)."""

    def forget_session(self, session: str) -> None:
        """Drop ``session``'s tags from every block (the blocks stay)."""

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """Remove these blocks and every block below them (a chain is only usable from its
        root), files and index rows included, with their tags; writes still queued for them are
        written first, then removed. Returns (blocks removed, bytes freed)."""

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        """Remove every block of the namespace ``root`` (a whole tenant); (blocks, bytes)."""

    def expire(self, now: float) -> int:
        """Remove blocks whose TTL hint (or the tier's own retention) ran out by ``now``, last
        use counted; their descendants go too. Returns the number removed."""

    def describe(self) -> dict[str, Any]:
        """Counters and settings for ``/v1/cache/stats`` (empty: nothing to show)."""

    def used_bytes(self) -> int:
        """Bytes this tier holds now."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless bytes accounted == bytes held <= budget, and no session
        tag or TTL hint is kept for a block the tier no longer holds."""

    def close(self) -> None:
        """Flush what is pending and release resources; safe to call twice."""


class LowerTier(TierReads, TierWrites, TierAdmin, Protocol):
    """A tier behind RAM, keyed by block hash (SSD, the shared tier): all three roles.

    Only ``tiers.stack.TierStack`` holds lower tiers: it hands them RAM's evicted blocks (and,
    when ``write_through``, every new one), asks them for a continuation RAM cannot serve and
    promotes the longest, and fans the admin operations out to them."""


class NullTier:
    """Holds nothing: eviction from RAM is final."""

    name = "null"
    write_through = False

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        pass

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool
    ) -> list[StoredBlock]:
        return []

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        return [KeyError(b.block_hash.hex()) for b in blocks]

    def put(self, record: BlockRecord) -> bool:
        return False

    def touch(self, hashes: list[BlockHash]) -> None:
        pass

    def note_miss(self, failed: bool) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> bool:
        return True

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        pass

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        return {}

    def forget_session(self, session: str) -> None:
        pass

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return 0, 0

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        return 0, 0

    def expire(self, now: float) -> int:
        return 0

    def describe(self) -> dict[str, Any]:
        return {}

    def used_bytes(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass


_TIERS: dict[str, Callable[..., LowerTier]] = {"null": NullTier}


def register_tier(name: str, factory: Callable[..., LowerTier]) -> None:
    _TIERS[name] = factory


def make_tier(name: str, **kwargs: Any) -> LowerTier:
    if name not in _TIERS:
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(sorted(_TIERS))}")
    return _TIERS[name](**kwargs)
