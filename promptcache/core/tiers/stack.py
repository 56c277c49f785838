"""TierStack: RAM and the tiers behind it, nearest first; the only holder of the lower tiers.

It owns the order: RAM never calls down and a store never calls up. After each operation that
changes RAM the stack takes RAM's moves (``settle``): new blocks go to the write-through tiers,
evicted ones down (spill). It runs a
promotion (``promotion``: plan, load, finish) against every tier that can hold something, fans
the admin operations (sessions, deletion, expiry, stats, checks, close) out to every tier that
has the capability (``base``: checked by protocol once, here), RAM first, and knows each tier by
name. The cache's lock is held by the caller for everything but
``load`` (slow reads). Deletions are counted here: a promotion planned before one inserts
nothing, so what was read outside the lock never brings a deleted block back.
"""

from __future__ import annotations

from collections.abc import Sequence

from promptcache.core.block import Block
from promptcache.core.figures import Snapshot
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import BlockUse, DeleteReport, merge_session_blocks
from promptcache.core.tiers import promotion
from promptcache.core.tiers.base import (
    BlockRecord,
    BlockStore,
    HasStats,
    NullTier,
    QueuesWrites,
    ReadResult,
    SessionAdmin,
    StoredBlock,
    Verifiable,
    WarmSource,
)
from promptcache.core.tiers.promotion import Promoted, PromotionPlan
from promptcache.core.tiers.ram.tier import RamTier
from promptcache.core.tree import Match

__all__ = ["QUEUED_SHARE", "TierStack", "as_tier_list"]

# of RAM's budget, the most that blocks queued for lower tiers' writers may hold (split between
# those tiers); RAM makes room for them as far as it can evict. Half the budget dropped writes
# of a small cache's every long prompt (its blocks are written only from the queue)
QUEUED_SHARE = 1.0


def as_tier_list(tiers: BlockStore | Sequence[BlockStore] | None) -> list[BlockStore]:
    """The lower tiers in order (nearest first); a lone tier or None accepted as before."""
    if tiers is None:
        return []
    if isinstance(tiers, Sequence):
        return list(tiers)
    return [tiers]


class TierStack:
    """Invariant: ``ram`` heads the stack (it records moves only when a store can hear of them,
    and every method that changes RAM settles them before it returns); ``lower_tiers`` is never
    empty (a ``NullTier`` when nothing is behind RAM, so stats still name a tier); ``stores``
    are the lower tiers that can hold anything, ``_write_through`` those of them that get every
    new block, ``_admin`` / ``_stats`` / ``_checked`` / ``_queues`` those with that capability.
    The blocks queued for the ``_queues``' writers count against RAM's budget (``QUEUED_SHARE``
    of it at most): RAM, those queues and the live requests are all the cache holds."""

    def __init__(self, ram: RamTier, lower: BlockStore | Sequence[BlockStore] | None) -> None:
        self.ram = ram
        self.lower_tiers: list[BlockStore] = as_tier_list(lower) or [NullTier()]
        # a subclass of NullTier (a test's recording tier) may hold things
        self.stores = [t for t in self.lower_tiers if type(t) is not NullTier]
        self._write_through = [t for t in self.stores if t.write_through]
        self._admin = [t for t in self.stores if isinstance(t, SessionAdmin)]
        self._stats = [t for t in self.lower_tiers if isinstance(t, HasStats)]
        self._checked = [t for t in self.lower_tiers if isinstance(t, Verifiable)]
        self._queues = [t for t in self.stores if isinstance(t, QueuesWrites)]
        self.num_deletions = 0  # bumped by every deletion; see the module docstring
        ram.records_moves = bool(self.stores)
        if self._queues:
            share = int(ram.budget_bytes * QUEUED_SHARE) // len(self._queues)
            for tier in self._queues:
                tier.limit_queued_bytes(share)
            ram.held_elsewhere = self.queued_bytes

    def queued_bytes(self) -> int:
        """Bytes of the blocks waiting for a lower tier's writer (safe from any thread)."""
        return sum(tier.queued_bytes() for tier in self._queues)

    def fit_budget(self) -> None:
        """Under the lock: evict (and spill) until RAM's blocks and the queued ones fit its
        budget together, as far as blocks can be evicted. RAM made room for the queue when it
        took its last block, but that block's write-through (or a spill) may queue after."""
        ram = self.ram
        while True:
            excess = ram.held_bytes + ram.reserved_bytes + self.queued_bytes() - ram.budget_bytes
            if excess <= 0 or not ram.evict_bytes(excess):
                return
            self._act_on_moves()

    @property
    def has_lower(self) -> bool:
        """Whether anything behind RAM can hold a block."""
        return bool(self.stores)

    def find(self, name: str) -> BlockStore | None:
        """The lower tier registered as ``name`` (``"ssd"``, ``"shared"``), if in the stack."""
        return next((t for t in self.stores if t.name == name), None)

    def warm_source(self) -> BlockStore | None:
        """The nearest store that can name its hottest prefixes (a ``WarmSource``: start-up
        warm-up), if any."""
        return next((t for t in self.stores if isinstance(t, WarmSource)), None)

    # -- routing: what RAM hands down --------------------------------------------------------

    def settle(self) -> None:
        """Act on RAM's moves since the last call, in order: a new block written through, an
        evicted one spilled (counted in RAM's ``num_spills`` when a tier took it); then keep
        RAM and the queues inside the budget (``fit_budget``)."""
        self._act_on_moves()
        if self._queues:
            self.fit_budget()

    def _act_on_moves(self) -> None:
        for move in self.ram.take_moves():
            if not move.evicted:
                self.write_through(move.block, move.source)
            elif self.spill(move.block):
                self.ram.counters.num_spills += 1

    def write_through(self, block: Block, source: BlockStore | None) -> None:
        """A new resident block goes to every write-through tier; one promoted from
        ``source`` only to those below it (the tiers above get it when RAM evicts it, so a
        promotion never rewrites a whole history while the request it serves runs)."""
        tiers = self._write_through
        if source is not None and source in self.lower_tiers:
            below = self.lower_tiers[self.lower_tiers.index(source) + 1 :]
            tiers = [t for t in tiers if t in below]
        if tiers:
            record = BlockRecord.from_block(block)
            for tier in tiers:
                tier.put(record)

    def spill(self, block: Block) -> bool:
        """An evicted block is offered to every lower tier (a write-through tier may have
        dropped it before); whether any took it."""
        if not self.stores:
            return False
        record = BlockRecord.from_block(block)
        return sum(tier.put(record) for tier in self.stores) > 0

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every tier's queued writes are done; False if one timed out."""
        self.settle()
        return all([tier.flush(timeout) for tier in self.stores])

    # -- promotion: a longer prefix behind RAM read back into it -----------------------------

    def plan_promotion(
        self, seq: TokenSeq, ram_match: Match, requires_checkpoint: bool
    ) -> PromotionPlan | None:
        """Under the lock: the longest continuation behind RAM that beats ``ram_match``, its
        RAM reserved (``promotion.plan``); None when there is none (or no tier to ask)."""
        if not self.stores:
            return None
        try:
            return promotion.plan(
                self.ram, self.stores, seq, ram_match, requires_checkpoint, self.num_deletions
            )
        finally:
            self.settle()  # making room may have evicted

    @staticmethod
    def load(plan: PromotionPlan) -> list[ReadResult]:
        """Outside the lock: the planned blocks, read and verified by their tier."""
        return promotion.load(plan)

    def finish_promotion(self, plan: PromotionPlan, loaded: list[ReadResult] | None) -> Promoted:
        """Under the lock again: release the plan, insert what was loaded (nothing when the
        load failed, ``loaded`` None, or a deletion ran meanwhile)."""
        if plan.num_deletions != self.num_deletions:
            loaded = None
        try:
            return promotion.finish(self.ram, plan, loaded)
        finally:
            self.settle()

    def warm(self, tier: BlockStore, blocks: list[StoredBlock], loaded: list[ReadResult]) -> int:
        """Under the lock: insert start-up warm-up blocks read from ``tier``."""
        try:
            return promotion.insert_warm(self.ram, blocks, loaded, tier)
        finally:
            self.settle()

    # -- admin fan-out: every tier, RAM first ------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        for tier in self._admin:
            tier.register_namespace(root, tenant)

    def tag_lower(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash
    ) -> None:
        """Tell the lower tiers of a use RAM already recorded (see ``PromptCache._note_use``)."""
        for tier in self._admin:
            tier.tag(hashes, use, now, root)

    def delete_session(self, key: str, force: bool) -> DeleteReport:
        """Remove the blocks only session ``key`` uses (shared ones too when ``force``) from
        every tier, with what hangs below them; what stays is no longer the session's."""
        tagged, shared = merge_session_blocks(
            [self.ram.session_blocks(key)] + [t.session_blocks(key) for t in self._admin]
        )
        targets = list(tagged if force else tagged - shared)
        report = DeleteReport(shared_kept=0 if force else len(shared))
        n, nbytes, report.pinned_kept = self.ram.remove_blocks(targets)
        report.tier(self.ram.name).add(n, nbytes)
        for tier in self.stores:
            report.tier(tier.name).add(*tier.delete_blocks(targets))
        self.num_deletions += 1
        self.ram.forget_session(key)
        for admin in self._admin:
            admin.forget_session(key)
        return report

    def delete_namespace(self, root: BlockHash) -> DeleteReport:
        """Every block of the namespace ``root`` (a whole tenant), in every tier."""
        report = DeleteReport()
        n, nbytes, report.pinned_kept = self.ram.remove_namespace(root)
        report.tier(self.ram.name).add(n, nbytes)
        for tier in self._admin:  # a store without it keeps no namespaces
            report.tier(tier.name).add(*tier.delete_namespace(root))
        self.num_deletions += 1
        return report

    def expire(self, now: float) -> dict[str, int]:
        """Blocks past their TTL in every tier; the number removed per tier."""
        out = {self.ram.name: self.ram.expire(now)}
        for tier in self._admin:
            out[tier.name] = tier.expire(now)
        return out

    def bytes_by_tier(self) -> dict[str, int]:
        return {
            self.ram.name: self.ram.used_bytes(),
            **{t.name: t.used_bytes() for t in self._stats},
        }

    def describe(self) -> dict[str, Snapshot]:
        """Each lower tier's ``describe()`` that has something to show, by name."""
        return {t.name: d for t in self._stats if (d := t.describe())}

    def check_integrity(self) -> None:
        self.settle()
        self.ram.check_integrity()
        for tier in self._checked:
            tier.check_integrity()

    def close(self) -> None:
        self.settle()
        for tier in self.lower_tiers:
            tier.close()
