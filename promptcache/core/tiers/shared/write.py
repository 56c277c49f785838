"""Writes of the shared tier (``SharedWriter``): a bounded write-behind queue and its writer.

A request never waits on Valkey to write: ``put`` queues the record (``write_behind``; full
queue or link down: dropped and counted) and the writer encodes it (``block_file.encode_block``),
writes the value, then its index entry (``scripts.PUT_LUA``). Touches and session tags go
through the same queue. The writer thread also probes the server while the link is down, so
the tier reconnects by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from promptcache.core.block_file import encode_block
from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK
from promptcache.core.tiers.base import BlockRecord
from promptcache.core.tiers.shared.context import SharedContext
from promptcache.core.tiers.shared.index import SharedEntry, pack_meta, session_id, unpack_meta
from promptcache.core.tiers.shared.scripts import PUT_LUA, TAG_LUA
from promptcache.core.tiers.write_behind import WriteBehind

SWEEP_PER_PUT = 16  # stale entries removed per put, at most (bounded script time)


class Touch(NamedTuple):
    root: BlockHash
    hashes: list[BlockHash]


class Tag(NamedTuple):
    """Session ids (``index.session_id``) to record on blocks of one namespace."""

    root: BlockHash
    hashes: list[BlockHash]
    sids: list[bytes]


class SharedWriter:
    """The shared tier's ``put``/``flush`` half (and its touches and tags): one write-behind
    queue (``write_behind``) whose writer thread also probes the server while the link is
    down, so the tier reconnects by itself (``on_reconnect`` then runs)."""

    def __init__(
        self, ctx: SharedContext, queue_blocks: int, on_reconnect: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self.keys, self.link, self.stats = ctx.keys, ctx.link, ctx.stats
        self._on_reconnect = on_reconnect
        self.queue: WriteBehind[BlockRecord | Touch | Tag] = WriteBehind(
            "promptcache-shared",
            self._handle,
            max_items=queue_blocks,
            on_error=self._failed,
            on_drop=self._dropped,
            idle=self._idle,
            size=lambda item: item.nbytes if isinstance(item, BlockRecord) else 0,
        )

    def put(self, record: BlockRecord) -> bool:
        if not self.ctx.is_usable:
            self.stats.add(dropped_writes=1)
            return False
        return self.queue.offer(record)

    def touch(self, hashes: Iterable[BlockHash], root: BlockHash | None = None) -> None:
        """A promotion from this tier (counted as a hit): refresh TTL and recency (queued;
        dropped when the queue is full). Without ``root``, each hash's root comes from this
        store's recent lookups and puts."""
        hs = list(hashes)
        self.stats.add(num_hits=1, num_promoted_blocks=len(hs))
        self.refresh(hs, root)

    def refresh(self, hashes: Iterable[BlockHash], root: BlockHash | None = None) -> None:
        """Refresh TTL and recency without counting a hit (queued)."""
        hs = list(hashes)
        if not self.ctx.is_usable or not hs:
            return
        for r, g in self.ctx.group_by_root(hs, root).items():
            self.enqueue(Touch(r, g))

    def enqueue(self, item: Touch | Tag) -> None:
        """Bookkeeping only: a full queue drops it (counted by ``_dropped``)."""
        self.queue.offer(item)

    def _dropped(self, item: BlockRecord | Touch | Tag) -> None:
        kind = "dropped_touches" if isinstance(item, (Touch, Tag)) else "dropped_writes"
        self.stats.add(**{kind: 1})

    def _idle(self) -> float:
        if not self.link.is_up and self.link.probe_due() and self.link.probe():
            self._on_reconnect()
        return 0.05 if not self.link.is_up else 1.0

    def _handle(self, item: BlockRecord | Touch | Tag) -> None:
        if isinstance(item, Touch):
            self._touch_now(item.root, item.hashes)
        elif isinstance(item, Tag):
            self._tag_now(item)
        elif not self.link.is_up:
            self.stats.add(dropped_writes=1)
        else:
            self._write(item)

    def _failed(self, item: BlockRecord | Touch | Tag, exc: Exception) -> None:
        """A codec that cannot store the payload, ...: this item is lost, counted."""
        self.stats.error(f"{type(exc).__name__}: {exc}", errors=1, dropped_writes=1)

    def _touch_now(self, root: BlockHash, hashes: list[BlockHash]) -> None:
        now = int(time.time() * 1000)
        z = self.keys.index(root)[2]

        def run(cl: Any) -> None:
            p = cl.pipeline(transaction=False)
            p.zadd(z, dict.fromkeys(hashes, now), xx=True)
            for h in hashes:
                p.pexpire(self.keys.data(h), self.ctx.ttl_ms)
            # the namespace's index lives as long as its blocks
            for k in dict.fromkeys(self.keys.namespace(root)):
                p.pexpire(k, self.ctx.ttl_ms)
            p.execute()

        self.link.call(run)

    def _write(self, record: BlockRecord) -> None:
        meta = record.meta
        root, h = meta.root, meta.block_hash
        keys = self.keys.namespace(root)
        sids = sorted(session_id(s) for s in record.sessions)
        old = self.link.call(lambda cl: cl.hget(keys[0], h))
        entry = unpack_meta(h, root, old) if old else None
        if entry is not None and (entry.has_checkpoint or record.checkpoint is None):
            self.stats.add(skipped_writes=1)
            self._touch_now(root, [h])
            if sids:
                self._tag_now(Tag(root, [h], sids))
            return
        data = encode_block(record, self.ctx.model, self.ctx.codec)
        entry = SharedEntry(meta, record.nbytes, record.checkpoint is not None, record.is_seq_end,
                            len(data))  # fmt: skip
        now = int(time.time() * 1000)
        args = [h, pack_meta(entry), now, self.ctx.ttl_ms, SWEEP_PER_PUT, 0, b"", root,
                MAX_SESSIONS_PER_BLOCK, *sids]  # fmt: skip
        if not self.link.cluster:  # value, entry and tags together, atomically (see PUT_LUA)
            keys += [self.keys.data(h), *(self.keys.session(s) for s in sids)]
            args[5:7] = [1, data]
        # cluster: the value before its entry, so an entry never names a value not yet written
        elif self.link.call(lambda cl: cl.set(self.keys.data(h), data, px=self.ctx.ttl_ms)) is None:
            self.stats.add(dropped_writes=1)
            return
        swept = self.link.call(lambda cl: self.ctx.eval(cl, PUT_LUA, keys, args))
        if swept is None:  # the value alone is unreachable; it expires with its TTL
            self.stats.add(dropped_writes=1)
            return
        if self.link.cluster and sids:
            self._add_to_sessions(root, [h], sids)
        self.stats.add(num_writes=1, bytes_written=len(data), num_swept=len(swept))
        if self.ctx.evictions is not None:  # unused for a TTL: a later miss can say "evicted"
            for x in swept:
                self.ctx.evictions.note(BlockHash(x[:16]), BlockHash(x[16:32]), self.ctx.name)
        self.ctx.note_roots([meta])

    def _tag_now(self, tag: Tag) -> None:
        m, _, _, t = self.keys.namespace(tag.root)
        sets = [] if self.link.cluster else [self.keys.session(s) for s in tag.sids]
        args = [self.ctx.ttl_ms, tag.root, MAX_SESSIONS_PER_BLOCK, len(tag.sids), *tag.sids,
                *tag.hashes]  # fmt: skip
        done = self.link.call(lambda cl: self.ctx.eval(cl, TAG_LUA, [m, t, *sets], args))
        if done and self.link.cluster:
            self._add_to_sessions(tag.root, [BlockHash(x) for x in done], tag.sids)

    def _add_to_sessions(self, root: BlockHash, hashes: list[BlockHash], sids: list[bytes]) -> None:
        """Cluster mode: the session sets lie in other slots than the namespace's tags."""

        def run(cl: Any) -> None:
            for s in sids:
                k = self.keys.session(s)
                cl.sadd(k, *(root + h for h in hashes))
                cl.pexpire(k, self.ctx.ttl_ms)

        self.link.call(run)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and touch is done; False on timeout."""
        return self.queue.flush(timeout)

    def close(self) -> None:
        # a full queue: the writer is stuck on a slow server (a daemon thread: left behind)
        self.queue.close(timeout=5.0)
