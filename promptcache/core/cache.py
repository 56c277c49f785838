"""PromptCache: the thread-safe facade engines and the server call.

Engine protocol: ``seq = cache.sequence(tokens, tenant=...)``; ``with cache.lookup(seq) as hit``
restores ``hit.num_tokens`` tokens of state from ``hit.segments()`` (and ``hit.checkpoint``);
then ``cache.save(seq, n, slice_positional, checkpoint)`` at each chunk boundary, at the end of
prefill and after generation (with the generated tokens appended via ``seq.extend``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from promptcache.core.block import Block
from promptcache.core.budget import default_ram_budget, parse_size
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import Namespace
from promptcache.core.lease import Lease, SaveResult
from promptcache.core.minisim import Census
from promptcache.core.policy import EvictionPolicy
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import BlockUse, DeleteReport, session_key
from promptcache.core.stats import CacheStats, Counters, LookupReport
from promptcache.core.tiers.base import BlockStore, StoredBlock
from promptcache.core.tiers.ram.tier import RamTier
from promptcache.core.tiers.stack import TierStack
from promptcache.core.tree import Match
from promptcache.core.whatif import attach_whatif

DEFAULT_BLOCK_SIZE = 64
EXPIRE_EVERY_S = 1.0  # expiry sweeps run on lookups and saves, at most this often
SlicePositional = Callable[[int, int], Any]


class PromptCache:
    def __init__(
        self,
        model_fingerprint: str,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        ram_budget: int | str | None = None,
        requires_checkpoint: bool = False,
        policy: EvictionPolicy | str | None = None,
        next_tier: BlockStore | Sequence[BlockStore] | None = None,
        evictions: EvictionLog | None = None,
        ram_ttl: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``next_tier``: the tiers behind RAM, nearest first (one tier alone is accepted).
        ``evictions``: the log the lower tiers note their evictions in (one is made if none).
        ``ram_ttl``: seconds a RAM block may go unused before it expires (None: never, unless
        a request's TTL hint says so). ``clock``: wall-clock seconds (a test's fake clock)."""
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        budget = default_ram_budget() if ram_budget is None else parse_size(ram_budget)
        self.model_fingerprint = model_fingerprint
        self.block_size = block_size
        self.requires_checkpoint = requires_checkpoint
        self.counters = Counters()
        # where evicted blocks went (shared with the lower tiers): a miss can say so
        self.evictions = evictions if evictions is not None else EvictionLog()
        self.ram = RamTier(budget, policy, self.counters, self.evictions, clock, ram_ttl)
        # the only holder of the tiers behind RAM (routing, promotion, admin, their stats)
        self.tiers = TierStack(self.ram, next_tier)
        self.clock = clock
        self._last_sweep = clock()
        self.whatif = attach_whatif(self.ram.policy, budget, block_size)
        if self.whatif is not None:
            self.ram.census = Census()
            self.whatif.follow(self.ram.census, self.ram.used_bytes)
        self._lock = threading.RLock()

    def sequence(
        self,
        tokens: Sequence[int] | np.ndarray,
        tenant: str = "",
        salt: str = "",
        extras: Mapping[int, bytes] | None = None,
        session: str = "",
        ttl_s: float | None = None,
    ) -> TokenSeq:
        """Tokens under this model's namespace for ``tenant``. ``session`` (inside the tenant)
        and ``ttl_s`` (a TTL hint) are recorded on every block the sequence's lookups and saves
        touch; neither changes a hash. Raises ValueError on bad ids."""
        root = Namespace(self.model_fingerprint, tenant, salt).root_hash()
        seq = TokenSeq(root, tokens, self.block_size, extras)
        if session or ttl_s is not None:
            seq.use = BlockUse(session_key(tenant, session) if session else "", ttl_s)
        self.tiers.register_namespace(root, tenant)
        return seq

    def _check_seq(self, seq: TokenSeq) -> None:
        if not isinstance(seq, TokenSeq):
            raise TypeError("expected a TokenSeq from PromptCache.sequence()")
        if seq.block_size != self.block_size:
            raise ValueError(
                f"sequence block size {seq.block_size} != cache block size {self.block_size}"
            )
        if seq.num_tokens == 0:
            raise ValueError("cannot look up or save an empty token sequence")

    def lookup(self, seq: TokenSeq) -> Lease:
        """Longest reusable prefix, pinned. Never covers the last token (its logits are needed).
        A longer prefix in a lower tier is promoted first, read outside the lock."""
        self._check_seq(seq)
        rc = self.requires_checkpoint
        with self._lock:
            self._maybe_expire()
            match = self.ram.match(seq, rc)
            plan = None
            if match.num_matched < seq.num_tokens - 1:
                # pinned while a promotion is planned and loaded: making room for it must never
                # evict the blocks this lookup already found (a served block must be resident)
                self.ram.pin(match.blocks)
                plan = self.tiers.plan_promotion(seq, match, rc)
                if plan is None:
                    self.ram.unpin(match.blocks)
            if plan is None:
                return self._serve(seq, match, match.num_tokens)
        try:
            loaded: list[Any] | None = self.tiers.load(plan)
        except BaseException:
            with self._lock:
                self.tiers.finish_promotion(plan, None)
                self.ram.unpin(match.blocks)
            raise
        with self._lock:
            done = self.tiers.finish_promotion(plan, loaded)
            self.ram.unpin(match.blocks)
            # matched again: RAM changed while the lock was let go
            return self._serve(
                seq, self.ram.match(seq, rc), match.num_tokens, plan.tier.name, done.num_damaged
            )

    def _serve(
        self, seq: TokenSeq, match: Match, from_ram: int, tier: str = "", num_damaged: int = 0
    ) -> Lease:
        """Count the lookup, pin its blocks (caller holds the lock). ``from_ram``: tokens RAM
        held before a promotion from ``tier``."""
        if self.whatif is not None:
            self.whatif.on_lookup(seq, match.num_tokens)
        c = self.counters
        c.num_lookups += 1
        c.lookup_tokens += seq.num_tokens
        if match.num_tokens:
            c.num_hits += 1
            c.hit_tokens += match.num_tokens
            c.hits_by_kind[match.kind] += 1
            self.ram.touch(match.blocks, is_hit=True)
            self._note_use(seq, match.blocks)
            self.ram.pin(match.blocks)
        report = self._report(seq, match, from_ram, tier, num_damaged)
        return Lease(self, match.num_tokens, match.blocks, match.kind, report)

    def _report(
        self, seq: TokenSeq, match: Match, from_ram: int, tier: str, num_damaged: int
    ) -> LookupReport:
        by_tier = {"ram": min(from_ram, match.num_tokens)}
        if match.num_tokens > from_ram and tier:
            by_tier[tier] = match.num_tokens - from_ram
        past = match.num_matched // self.block_size  # the first block the cache did not have
        parent = seq.block_hash(past - 1) if past else seq.root
        full = seq.block_hash(past) if past < seq.num_full_blocks else parent
        evicted = self.evictions.find(full, parent)
        return LookupReport(
            match.num_tokens, match.kind, match.num_matched, by_tier, num_damaged,
            self.requires_checkpoint, evicted,
        )  # fmt: skip

    def _release(self, lease: Lease) -> None:
        # the check and the unpin under one lock: the stepping thread and a request's consumer
        # may both release it, and a second unpin would take another request's pin
        with self._lock:
            if not lease.is_released:
                lease.is_released = True
                self.ram.unpin(lease.blocks)

    def save(
        self,
        seq: TokenSeq,
        num_tokens: int | None = None,
        slice_positional: SlicePositional | None = None,
        checkpoint: Any = None,
    ) -> SaveResult:
        """Save state for ``seq[:num_tokens]``; only blocks not already resident are created.

        ``slice_positional(start, end)`` returns an owning (not a view) payload for those
        positions and is called only for new blocks, outside the lock. ``checkpoint`` is the
        snapshot state at exactly ``num_tokens``. When the budget cannot make room (everything
        else pinned) the save stops early; the resident prefix stays consistent.
        """
        self._check_seq(seq)
        n = seq.num_tokens if num_tokens is None else num_tokens
        if not 0 < n <= seq.num_tokens:
            raise ValueError(f"num_tokens must be in [1, {seq.num_tokens}], got {num_tokens}")
        b = self.block_size
        num_full = n // b
        for i in range(num_full):  # hash outside the lock
            seq.block_hash(i)
        with self._lock:
            first_new = len(self.ram.full_path(seq, num_full))
        # build new payloads outside the lock: engine copies can be slow
        payloads = {
            i: slice_positional(i * b, (i + 1) * b) if slice_positional else None
            for i in range(first_new, num_full)
        }
        with self._lock:
            try:
                return self._save_locked(seq, n, payloads, slice_positional, checkpoint)
            finally:
                self.tiers.settle()  # RAM's new and evicted blocks to the tiers behind it

    def _save_locked(
        self,
        seq: TokenSeq,
        n: int,
        payloads: dict[int, Any],
        slice_positional: SlicePositional | None,
        checkpoint: Any,
    ) -> SaveResult:
        b = self.block_size
        num_full = n // b
        self._maybe_expire()
        self.counters.num_saves += 1
        path = self.ram.full_path(seq, num_full)
        node = path[-1] if path else self.ram.root(seq.root)
        num_new, new_bytes, new_tokens, complete = 0, 0, 0, True
        for i in range(len(path), num_full):
            if i in payloads:
                payload = payloads[i]
            else:  # another thread evicted it meanwhile
                payload = slice_positional(i * b, (i + 1) * b) if slice_positional else None
            blk = self.ram.insert(node, seq.block_meta(i), payload, use=seq.use)
            if blk is None:
                complete = False
                break
            self._drop_superseded(node, blk)
            num_new += 1
            new_bytes += blk.nbytes
            new_tokens += b
            path.append(blk)
            node = blk
        last: Block | None = node
        if complete and n > num_full * b:
            last, is_new = self._save_tail(seq, node, num_full * b, n, slice_positional, checkpoint)
            if last is not None:
                path.append(last)
            if is_new and last is not None:
                num_new += 1
                new_bytes += last.nbytes
                new_tokens += last.num_tokens
        if complete and last is not None and last.parent is not None and last.end == n:
            last.is_seq_end = True
            has_room = (
                checkpoint is not None
                and last.checkpoint is None
                and self.ram.attach_checkpoint(last, checkpoint)
            )
            if has_room:
                self.counters.num_saved_checkpoints += 1
        self.ram.touch(path, is_hit=False)
        self._note_use(seq, path)
        self.ram.prune_root(seq.root)
        if self.whatif is not None:
            self.whatif.note_saved(new_bytes, new_tokens)
            self.whatif.on_save(seq, n)
        self.counters.num_saved_blocks += num_new
        # complete: every position up to n is resident (in a new block, an old one, or a
        # longer block covering the tail); otherwise the save stopped after the path's blocks
        has_tail = n == num_full * b or last is not None
        cached = n if complete and has_tail else min(len(path) * b, n)
        return SaveResult(num_new, new_bytes, cached)

    def _save_tail(
        self,
        seq: TokenSeq,
        parent: Block,
        start: int,
        end: int,
        slice_positional: SlicePositional | None,
        checkpoint: Any,
    ) -> tuple[Block | None, bool]:
        """(resident block holding positions [start, end), whether it is new; None when no room).
        A partial block is created only when it adds something: new positions, or a place for
        a checkpoint; otherwise the longer block that already covers them is returned."""
        # an existing block with these positions: the same partial block, or (unless a
        # checkpoint needs its own place at ``end``) a longer one that covers them
        found = self.ram.find_partial(seq, parent.block_hash, start, end, checkpoint is None)
        if found is not None:
            return found, False
        payload = slice_positional(start, end) if slice_positional else None
        blk = self.ram.insert(parent, seq.partial_meta(end), payload, use=seq.use)
        return blk, blk is not None

    def _note_use(self, seq: TokenSeq, blocks: tuple[Block, ...] | list[Block]) -> None:
        """Session tag, TTL hint and time of use on the blocks (caller holds the lock). Lower
        tiers hear only what is new to a block (a session or a longer hint RAM did not have):
        a session hitting its own blocks in RAM costs them nothing. Their copy's last use may
        then lag while RAM serves it; an expired copy comes back with RAM's tags on eviction."""
        use = seq.use
        new = [] if use.is_empty else [b.block_hash for b in blocks if _is_news(b, use)]
        self.ram.note_use(blocks, use, self.clock())
        if new:
            self.tiers.tag_lower(new, use, self.clock(), seq.root)

    def _maybe_expire(self) -> None:
        """An expiry sweep once per ``EXPIRE_EVERY_S`` while any TTL is in play (caller holds
        the lock): the sweep walks the RAM index, so it is kept off most requests."""
        # RAM's sweep walks every block: only once a TTL is in play (--ram-ttl, or a hint seen);
        # lower tiers keep hints across restarts and look them up by index: always swept
        swept = self.ram.has_ttl or self.tiers.has_lower
        if swept and self.clock() - self._last_sweep >= EXPIRE_EVERY_S:
            self.expire()

    def expire(self, now: float | None = None) -> dict[str, int]:
        """Remove blocks unused past their TTL in every tier now; the count per tier."""
        with self._lock:
            now = self.clock() if now is None else now
            self._last_sweep = now
            return self.tiers.expire(now)

    def delete_session(self, session: str, tenant: str = "", force: bool = False) -> DeleteReport:
        """Remove the blocks only ``session`` (of ``tenant``) uses from every tier, with what
        hangs below them; shared ones too when ``force``. Pinned blocks stay (reported)."""
        with self._lock:
            return self.tiers.delete_session(session_key(tenant, session), force)

    def delete_tenant(self, tenant: str) -> DeleteReport:
        """Remove every block of ``tenant``'s namespace from every tier."""
        with self._lock:
            return self.tiers.delete_namespace(
                Namespace(self.model_fingerprint, tenant).root_hash()
            )

    def _drop_superseded(self, parent: Block, full: Block) -> None:
        for child in list(parent.children.get(full.first_token(), ())):
            if (
                child is not full
                and child.num_tokens < self.block_size
                and child.checkpoint is None
                and child.is_evictable
                and full.token_bytes.startswith(child.token_bytes)
            ):
                self.ram.discard(child)
                self.counters.num_superseded += 1

    def stats(self) -> CacheStats:
        with self._lock:
            num_blocks, num_pinned = self.ram.count_blocks()
            return CacheStats(
                **self.counters.snapshot(),
                num_blocks=num_blocks,
                num_pinned_blocks=num_pinned,
                bytes_by_tier=self.tiers.bytes_by_tier(),
                ram_budget_bytes=self.ram.budget_bytes,
                tiers=self.tiers.describe(),
                block_size=self.block_size,
                policy=self.ram.policy.name,
                whatif=self.whatif.snapshot() if self.whatif is not None else None,
                ram_ttl_s=self.ram.ttl_s,
            )

    def warm(self, tier: BlockStore, blocks: list[StoredBlock]) -> int:
        """Start-up warm-up: read ``blocks`` (parent before child, e.g. a shared tier's hottest
        prefixes) from ``tier`` outside the lock, then insert them under it by promotion's rules
        (``promotion.insert_warm``). Not counted as hits. Returns the number inserted."""
        loaded = tier.read(blocks)
        with self._lock:
            return self.tiers.warm(tier, blocks, loaded)

    def check_integrity(self) -> None:
        with self._lock:
            self.tiers.check_integrity()

    def close(self) -> None:
        self.tiers.close()


def _is_news(block: Block, use: BlockUse) -> bool:
    """Whether ``use`` tells a lower tier anything it may not know about ``block`` yet."""
    if use.session and (block.sessions is None or use.session not in block.sessions):
        return True
    return use.ttl_s is not None and (block.ttl_s is None or block.ttl_s < use.ttl_s)
