"""The tiers behind RAM: the ``BlockStore`` protocol every one implements, the optional
capabilities checked by protocol (``LookupFeedback``, ``SessionAdmin``, ``HasStats``,
``Verifiable``, ``WarmSource``), what passes between them, and the null tier. Tiers are
registered by name in ``registry``."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

from promptcache.core.block import Block, BlockMeta
from promptcache.core.figures import Snapshot
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


@runtime_checkable
class BlockStore(Protocol):
    """A tier behind RAM, keyed by block hash (SSD, the shared tier): the six calls every one
    implements. What more it can do is an optional capability below, checked by protocol.

    Only ``tiers.stack.TierStack`` holds block stores: it hands them RAM's evicted blocks (and,
    when ``write_through``, every new one), asks them for a continuation RAM cannot serve and
    promotes the longest, and fans deletions out to them. Calls come from several request
    threads at once (under the cache's lock for all but ``read``), and from the stack alone:
    a store never calls back into the stack or RAM."""

    name: str  # its registered name, in stats and reports
    write_through: bool  # True: the stack also puts every new block, not only evicted ones

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool
    ) -> list[StoredBlock]:
        """Blocks continuing ``seq`` after full block ``start - 1`` (hash ``parent``), found by
        the shared walk (``chain``): whole blocks, then the best partial one; with
        ``requires_checkpoint`` only up to the deepest checkpoint a hit could end on. Reads no
        payload; [] when it holds nothing (or cannot answer now). Never raises; no side effect
        but counting, so asking twice is harmless."""

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        """Each block's (payload, checkpoint), verified, or the exception that makes it
        unusable (damaged: the store quarantines it, ``is_damage`` True; gone since the lookup:
        nothing is wrong). Called outside the cache's lock: slow I/O belongs here. Reading a
        block twice reads it twice."""

    def put(self, record: BlockRecord) -> bool:
        """Accept a block (evicted, or new when ``write_through``). Must not block the caller:
        it may queue the write or drop the block (returning False). Putting the same hash twice
        is harmless."""

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """Remove these blocks and every block below them (a chain is only usable from its
        root), with their tags; writes still queued for them are written first, then removed.
        Returns (blocks removed, bytes freed); hashes it does not hold are ignored, so deleting
        twice removes nothing the second time."""

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done; False on timeout. Safe any time."""

    def close(self) -> None:
        """Flush what is pending and release resources; safe to call twice."""


@runtime_checkable
class LookupFeedback(Protocol):
    """A store told what came of its lookups (for recency and its hit counters)."""

    def touch(self, hashes: list[BlockHash]) -> None:
        """These blocks were promoted to RAM (a hit of this store): count it, refresh recency."""

    def note_miss(self, failed: bool) -> None:
        """A lookup asked this store and promoted nothing from it: its continuation was not the
        longest (``failed`` False), or RAM had no room for it (``failed`` True)."""


@runtime_checkable
class SessionAdmin(Protocol):
    """Sessions, tenants and expiry: a tier that keeps blocks by session or tenant, or expires
    them. RAM implements it too, so the stack fans each operation out to every tier alike. A
    store without it keeps no tags: a session's deletion reaches it only by block hash."""

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
        """Drop ``session``'s tags from every block (the blocks stay); safe to call twice."""

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        """Remove every block of the namespace ``root`` (a whole tenant); (blocks, bytes)."""

    def expire(self, now: float) -> int:
        """Remove blocks whose TTL hint (or the tier's own retention) ran out by ``now``, last
        use counted; their descendants go too. Returns the number removed."""


@runtime_checkable
class HasStats(Protocol):
    """A tier with figures to show (``/v1/cache/stats``, ``/metrics``)."""

    def describe(self) -> Snapshot:
        """Counters and settings, typed for ``/metrics`` and read as a mapping for
        ``/v1/cache/stats`` (empty: nothing to show). Taken at one moment."""

    def used_bytes(self) -> int:
        """Bytes this tier holds now."""


@runtime_checkable
class Verifiable(Protocol):
    """A tier that can check its own accounting (tests, ``cache verify``)."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless bytes accounted == bytes held <= budget, and no session
        tag or TTL hint is kept for a block the tier no longer holds."""


@runtime_checkable
class QueuesWrites(Protocol):
    """A store whose ``put`` queues the block for a writer thread: until written it stays in
    this process's memory, so the stack counts it against RAM's budget."""

    def queued_bytes(self) -> int:
        """Bytes of the blocks accepted and not yet written (the one being written included).
        Read without the cache's lock: it may fall (a write done) at any moment."""

    def limit_queued_bytes(self, nbytes: int) -> None:
        """From now on ``put`` drops a block (False, counted as dropped) that would take the
        queued bytes past ``nbytes``, unless nothing is queued. Calling again replaces it."""


@runtime_checkable
class WarmSource(Protocol):
    """A tier that can name its hottest prefixes for a new server's start-up warm-up."""

    def hottest_blocks(self, byte_budget: int, time_limit_s: float) -> list[StoredBlock]:
        """The most recently used blocks with their ancestors, parent before child, within
        ``byte_budget`` stored bytes and ``time_limit_s``."""

    def note_warmed(self, num_blocks: int, nbytes: int) -> None:
        """Count what a warm-up pulled from this tier into RAM."""


class NullTier:
    """Holds nothing: eviction from RAM is final. A ``BlockStore`` with (empty) stats."""

    name = "null"
    write_through = False

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool
    ) -> list[StoredBlock]:
        return []

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        return [KeyError(b.block_hash.hex()) for b in blocks]

    def put(self, record: BlockRecord) -> bool:
        return False

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return 0, 0

    def flush(self, timeout: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass

    def describe(self) -> Snapshot:
        return Snapshot({})

    def used_bytes(self) -> int:
        return 0
