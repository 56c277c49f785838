"""Byte-budgeted RAM tier: resident blocks, pins, eviction of leaves, its sessions, deletion and
expiry. It never calls the tiers behind it: what they must hear of (new blocks, evictions) it
records as ``Move``s, which the ``TierStack`` that owns it takes and acts on."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from promptcache.core.block import TICKS_PER_BYTE, Block, BlockMeta, payload_nbytes, stamp_use
from promptcache.core.chain import find_partial
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.minisim import Census
from promptcache.core.policies import make_policy
from promptcache.core.policy import EvictionPolicy
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import NO_USE, BlockUse
from promptcache.core.stats import Counters
from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.ram import sessions
from promptcache.core.tiers.ram.integrity import check_ram
from promptcache.core.tree import Match, PrefixTree


class CacheBudgetError(ValueError):
    """A single block (or checkpoint) is larger than the whole RAM budget."""


class Move(NamedTuple):
    """What RAM did that the tiers behind it must hear of (``TierStack.settle`` acts on it):
    a block made resident (``evicted`` False; ``source``: the store it was promoted from) or
    one evicted."""

    block: Block
    source: BlockStore | None
    evicted: bool


class RamTier:
    """Invariant: ``held_bytes`` == sum of resident ``nbytes``, ``held_bytes + reserved_bytes
    <= budget_bytes``; every resident block's parent is resident (or a root); the policy holds
    exactly the evictable ones; while ``records_moves`` every insertion and eviction is in
    ``moves`` until taken. Room is made for ``held_bytes + reserved_bytes + held_elsewhere()
    <= budget_bytes`` as far as blocks can be evicted (the last term may grow between calls).
    Not thread-safe: the owning cache serialises calls. Implements ``SessionAdmin`` (sessions, deletion, expiry: ``ram.sessions``), ``HasStats`` and
    ``Verifiable`` like the tiers behind it."""

    name = "ram"

    def __init__(
        self,
        budget_bytes: int,
        policy: EvictionPolicy | str | None = None,
        counters: Counters | None = None,
        evictions: EvictionLog | None = None,
        wall_clock: Callable[[], float] = time.time,
        ttl_s: float | None = None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"RAM budget must be positive, got {budget_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ram_ttl must be positive, got {ttl_s!r}")
        self.budget_bytes = budget_bytes
        self.policy = (
            policy if policy is not None and not isinstance(policy, str) else make_policy(policy)
        )
        # set by the ``TierStack`` when a tier behind RAM can hold blocks: only then is there
        # anyone to hear of a move, so a RAM-only cache records none
        self.records_moves = False
        self.moves: list[Move] = []
        self.counters = counters or Counters()
        self.evictions = evictions if evictions is not None else EvictionLog()
        self.tree = PrefixTree()
        self.held_bytes = 0
        self.reserved_bytes = 0  # promised to promotions loading outside the lock
        # bytes of the budget the cache holds outside this tier (blocks queued for a lower
        # tier's writer): set by the ``TierStack``
        self.held_elsewhere: Callable[[], int] = lambda: 0
        self.clock = 0
        self.wall_clock = wall_clock  # seconds, for TTL expiry (``clock`` counts bytes and uses)
        self.ttl_s = ttl_s  # a block unused this long expires (None: only by its TTL hint)
        # expiry sweeps walk every block: only once a TTL is in play (ttl_s, or a hint seen)
        self.has_ttl = ttl_s is not None
        self.census: Census | None = None  # set when what-if miniatures follow this tier

    def __len__(self) -> int:
        return len(self.tree)

    # -- reading -----------------------------------------------------------------------------

    def match(self, seq: TokenSeq, requires_checkpoint: bool = False) -> Match:
        return self.tree.match(seq, requires_checkpoint)

    def get(self, block_hash: BlockHash) -> Block | None:
        return self.tree.index.get(block_hash)

    def full_path(self, seq: TokenSeq, num_full: int) -> list[Block]:
        """The resident whole blocks of ``seq``'s first ``num_full``, from its root."""
        return self.tree.full_path(seq, num_full)

    def find_partial(
        self, seq: TokenSeq, parent: BlockHash, start: int, end: int, longer: bool
    ) -> Block | None:
        """A resident block under ``parent`` holding positions [start, end) (``chain``)."""
        return find_partial(self.tree, seq, parent, start, end, longer=longer)

    def count_blocks(self) -> tuple[int, int]:
        """(resident blocks, those pinned by a request)."""
        index = self.tree.index
        return len(index), sum(1 for b in index.values() if b.ref_count)

    def touch(self, blocks: tuple[Block, ...] | list[Block], is_hit: bool) -> None:
        """A chain of blocks was used (a lookup hit, or a save)."""
        if not blocks:
            return
        self.clock += 1
        now = self.clock
        self.policy.on_access(blocks, is_hit, now)
        stamp_use(blocks, now, is_hit)

    def pin(self, blocks: tuple[Block, ...] | list[Block]) -> None:
        """Keep resident blocks from eviction until ``unpin``; only resident ones: a block
        pinned after it left the tree would come back to the policy on its unpin."""
        index = self.tree.index
        for blk in blocks:
            assert index.get(blk.block_hash) is blk, "pin of a block that is not resident"
            if blk.ref_count == 0 and blk.num_children == 0:
                self.policy.remove_evictable(blk)
            blk.ref_count += 1

    def unpin(self, blocks: tuple[Block, ...] | list[Block]) -> None:
        for blk in blocks:
            assert blk.ref_count > 0, "unpin without pin"
            blk.ref_count -= 1
            if blk.is_evictable:
                self.policy.add_evictable(blk)

    # -- writing -----------------------------------------------------------------------------

    def insert(
        self,
        parent: Block,
        meta: BlockMeta,
        payload: Any,
        *,
        checkpoint: Any = None,
        use: BlockUse = NO_USE,
        source: BlockStore | None = None,
    ) -> Block | None:
        """Make a new block resident under ``parent`` (``meta`` chains to it); None when no
        room can be made. Raises CacheBudgetError, changing nothing, when the block alone
        exceeds the budget. ``source``: the lower tier it was read from; it is then written
        through only to the tiers below that one (which may lack it): the tiers above get it
        when RAM evicts it, so a promotion never writes a whole history to the SSD while the
        request it serves is running.
        """
        assert meta.parent_hash == parent.block_hash
        nbytes = payload_nbytes(payload) + payload_nbytes(checkpoint)
        if nbytes > self.budget_bytes:
            raise CacheBudgetError(
                f"a block of {nbytes} bytes exceeds the whole RAM budget of {self.budget_bytes} "
                "bytes; raise --ram-budget or lower --block-size"
            )
        block = Block(
            meta.block_hash, parent, meta, payload=payload, checkpoint=checkpoint, nbytes=nbytes
        )
        if not self._make_room(nbytes, protect=parent, candidate=block):
            self.counters.num_save_skipped_blocks += 1
            return None
        if parent.is_evictable:
            self.policy.remove_evictable(parent)
        self.tree.add(block)
        self.held_bytes += nbytes
        if self.census is not None:
            self.census.counts[meta.block_hash[-1]] += nbytes
        self.clock += max(nbytes, 1) * TICKS_PER_BYTE
        block.last_access = self.clock
        self.policy.on_insert(block)
        self.policy.add_evictable(block)
        sessions.tag_blocks((block,), use, self.wall_clock())
        self._write_through_put(block, source)
        return block

    def attach_checkpoint(self, block: Block, checkpoint: Any) -> bool:
        """Give a resident block a checkpoint at its end; False when no room can be made."""
        if block.checkpoint is not None:
            return True
        nbytes = payload_nbytes(checkpoint)
        if block.nbytes + nbytes > self.budget_bytes:
            raise CacheBudgetError(f"checkpoint of {nbytes} bytes does not fit the RAM budget")
        if not self._make_room(nbytes, protect=block, candidate=block):
            self.counters.num_save_skipped_blocks += 1
            return False
        block.checkpoint = checkpoint
        block.nbytes += nbytes
        self.held_bytes += nbytes
        if self.census is not None:
            self.census.counts[block.block_hash[-1]] += nbytes
        self._write_through_put(block)
        return True

    def _write_through_put(self, block: Block, source: BlockStore | None = None) -> None:
        if self.records_moves:
            self.moves.append(Move(block, source, False))

    def take_moves(self) -> list[Move]:
        """The moves since the last call, in order (the caller acts on them)."""
        moves, self.moves = self.moves, []
        return moves

    def reserve(self, nbytes: int, protect: Block) -> bool:
        """Evict leaves (never ``protect`` or its ancestors) until ``nbytes`` more fit, then
        hold them for the caller (``unreserve`` gives them back) so no save takes them."""
        if nbytes > self.budget_bytes or not self._make_room(
            nbytes, protect=protect, candidate=protect
        ):
            return False
        self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.reserved_bytes
        self.reserved_bytes -= nbytes

    def hold(self, block: Block) -> None:
        """Pin one block, a namespace root too, while the lock is let go (a promotion's parent)."""
        if block.parent is None:
            block.ref_count += 1
        else:
            self.pin((block,))

    def let_go(self, block: Block) -> None:
        if block.parent is None:
            assert block.ref_count > 0, "let_go without hold"
            block.ref_count -= 1
        else:
            self.unpin((block,))

    def discard(self, block: Block) -> None:
        """Drop an evictable block without spilling it (it is redundant)."""
        assert block.is_evictable
        self.policy.remove_evictable(block)
        self._remove(block)

    def root(self, root_hash: BlockHash) -> Block:
        root = self.tree.root(root_hash, create=True)
        assert root is not None
        return root

    def prune_root(self, root_hash: BlockHash) -> None:
        """Forget a namespace root that holds no blocks (safe to call any time)."""
        root = self.tree.roots.get(root_hash)
        if root is not None and root.num_children == 0 and root.ref_count == 0:
            del self.tree.roots[root_hash]

    # -- eviction ----------------------------------------------------------------------------

    def _make_room(self, nbytes: int, protect: Block, candidate: Block) -> bool:
        hard = self.budget_bytes - self.reserved_bytes
        budget = hard - self.held_elsewhere()
        if self.held_bytes + nbytes <= budget:
            return True
        # pin the block being extended so making room never evicts the chain being saved
        protect.ref_count += 1
        was_evictable = (
            protect.parent is not None and protect.ref_count == 1 and protect.num_children == 0
        )
        if was_evictable:
            self.policy.remove_evictable(protect)
        try:
            while self.held_bytes + nbytes > budget:
                victim = self.policy.pop_victim()
                if victim is None:
                    break
                if not self.policy.admit(candidate, victim):
                    self.policy.add_evictable(victim)
                    break
                self._evict(victim)
            # the bytes held elsewhere are made room for as far as eviction can; the budget is
            # never passed
            return self.held_bytes + nbytes <= hard
        finally:
            protect.ref_count -= 1
            if protect.is_evictable:
                self.policy.add_evictable(protect)

    def evict_bytes(self, nbytes: int) -> int:
        """Evict leaves until ``nbytes`` are freed or nothing is evictable; returns bytes freed."""
        freed = 0
        while freed < nbytes:
            victim = self.policy.pop_victim()
            if victim is None:
                break
            freed += victim.nbytes
            self._evict(victim)
        return freed

    def _evict(self, victim: Block) -> None:
        self._remove(victim)
        self.counters.num_evictions += 1
        assert victim.parent is not None
        self.evictions.note(victim.block_hash, victim.parent.block_hash, self.name)
        if self.records_moves:
            self.moves.append(Move(victim, None, True))

    def _remove(self, block: Block) -> None:
        parent = block.parent
        self.tree.remove(block)
        self.held_bytes -= block.nbytes
        if self.census is not None:
            self.census.counts[block.block_hash[-1]] -= block.nbytes
        self.policy.on_evict(block)
        if parent is not None and parent.is_evictable:
            self.policy.add_evictable(parent)

    # -- SessionAdmin: sessions, deletion, expiry (``ram.sessions``); nothing removed spills --

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        pass  # RAM keys nothing by tenant name

    def note_use(self, blocks: Iterable[Block], use: BlockUse, now: float) -> None:
        """Session tag, TTL hint and time of use on resident blocks (a hit, or a save)."""
        sessions.tag_blocks(blocks, use, now)
        self.has_ttl = self.has_ttl or use.ttl_s is not None

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        index = self.tree.index
        self.note_use([b for h in hashes if (b := index.get(h)) is not None], use, now)

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        return sessions.session_blocks(self, session)

    def forget_session(self, session: str) -> None:
        sessions.forget_session(self, session)

    def remove_blocks(self, hashes: list[BlockHash]) -> tuple[int, int, int]:
        """``delete_blocks`` plus the number of blocks kept because a request pins them."""
        n, nbytes, kept = sessions.remove_blocks(self, hashes)
        self.counters.num_deleted += n
        for root in [h for h, r in self.tree.roots.items() if r.num_children == 0]:
            self.prune_root(root)
        return n, nbytes, kept

    def remove_namespace(self, root: BlockHash) -> tuple[int, int, int]:
        n, nbytes, kept = sessions.remove_namespace(self, root)
        self.counters.num_deleted += n
        return n, nbytes, kept

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return self.remove_blocks(hashes)[:2]

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        return self.remove_namespace(root)[:2]

    def expire(self, now: float) -> int:
        n = sessions.expire(self, now, self.ttl_s) if self.has_ttl else 0
        self.counters.num_expired += n
        return n

    def describe(self) -> dict[str, Any]:
        return {}  # RAM's figures are the cache's own stats

    def used_bytes(self) -> int:
        return self.held_bytes

    def close(self) -> None:
        pass

    # -- checks ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless accounting, reachability, pins and policy agree."""
        check_ram(self)
