"""Writes of the shared tier: a bounded queue drained by one writer thread.

A request never waits on Valkey to write: ``put`` queues the record (full queue or link down:
dropped and counted) and the writer encodes it (``block_file.encode_block``), writes the value,
then its index entry (``valkey_index.PUT_LUA``). Touches go through the same queue. The writer
thread also probes the server while the link is down, so the tier reconnects by itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, NamedTuple

from valkey.exceptions import NoScriptError

from promptcache.core.block import BlockMeta
from promptcache.core.block_file import encode_block
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK
from promptcache.core.tiers.base import BlockRecord
from promptcache.core.tiers.shared.index import (
    Keys,
    SharedEntry,
    pack_meta,
    session_id,
    unpack_meta,
)
from promptcache.core.tiers.shared.link import SharedStats, ValkeyLink
from promptcache.core.tiers.shared.scripts import PUT_LUA, TAG_LUA

SWEEP_PER_PUT = 16  # stale entries removed per put, at most (bounded script time)


class Touch(NamedTuple):
    root: BlockHash
    hashes: list[BlockHash]


class Tag(NamedTuple):
    """Session ids (``valkey_index.session_id``) to record on blocks of one namespace."""

    root: BlockHash
    hashes: list[BlockHash]
    sids: list[bytes]


def run_script(client: Any, src: str, sha: str, keys: list[str], args: list[Any]) -> Any:
    try:
        return client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:  # a restarted (or new) server: EVAL loads it into the script cache
        return client.eval(src, len(keys), *keys, *args)


class SharedWrites:
    """The write half of ``ValkeyStore`` (a mixin: the store owns the state below)."""

    model: str
    keys: Keys
    codec: PayloadCodec
    link: ValkeyLink
    stats: SharedStats
    ttl_ms: int
    name: str
    evictions: EvictionLog | None
    _closed: bool
    _lock: threading.Lock
    _roots: OrderedDict[BlockHash, BlockHash]
    _queue: queue.Queue[BlockRecord | Touch | Tag | None]

    def _eval(self, client: Any, src: str, keys: list[str], args: list[Any]) -> Any:
        raise NotImplementedError

    def _note_roots(self, metas: Iterable[BlockMeta]) -> None:
        raise NotImplementedError

    def _check_server(self) -> None:
        raise NotImplementedError

    def put(self, record: BlockRecord) -> bool:
        if self._closed or not self.link.is_up:
            self.stats.add(dropped_writes=1)
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.stats.add(dropped_writes=1)
            return False
        return True

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
        if self._closed or not self.link.is_up or not hs:
            return
        with self._lock:
            groups: dict[BlockHash, list[BlockHash]] = {}
            for h in hs:
                r = root or self._roots.get(h)
                if r is not None:
                    groups.setdefault(r, []).append(h)
        for r, g in groups.items():
            self._enqueue(Touch(r, g))

    def _enqueue(self, item: Touch | Tag) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # bookkeeping only: a full queue drops it (counted)
            self.stats.add(dropped_touches=1)

    def _loop(self) -> None:
        while True:
            if not self.link.is_up and self.link.probe_due() and self.link.probe():
                self._check_server()
            try:
                item = self._queue.get(timeout=0.05 if not self.link.is_up else 1.0)
            except queue.Empty:
                continue
            try:
                if item is None:
                    break
                if isinstance(item, Touch):
                    self._touch_now(item.root, item.hashes)
                elif isinstance(item, Tag):
                    self._tag_now(item)
                elif not self.link.is_up:
                    self.stats.add(dropped_writes=1)
                else:
                    self._write(item)
            except Exception as exc:  # a codec that cannot store the payload, ...
                self.stats.error(f"{type(exc).__name__}: {exc}", errors=1, dropped_writes=1)
            finally:
                self._queue.task_done()

    def _touch_now(self, root: BlockHash, hashes: list[BlockHash]) -> None:
        now = int(time.time() * 1000)
        z = self.keys.index(root)[2]

        def run(cl: Any) -> None:
            p = cl.pipeline(transaction=False)
            p.zadd(z, dict.fromkeys(hashes, now), xx=True)
            for h in hashes:
                p.pexpire(self.keys.data(h), self.ttl_ms)
            # the namespace's index lives as long as its blocks
            for k in dict.fromkeys(self.keys.namespace(root)):
                p.pexpire(k, self.ttl_ms)
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
        data = encode_block(record, self.model, self.codec)
        entry = SharedEntry(meta, record.nbytes, record.checkpoint is not None, record.is_seq_end,
                            len(data))  # fmt: skip
        now = int(time.time() * 1000)
        args = [h, pack_meta(entry), now, self.ttl_ms, SWEEP_PER_PUT, 0, b"", root,
                MAX_SESSIONS_PER_BLOCK, *sids]  # fmt: skip
        if not self.link.cluster:  # value, entry and tags together, atomically (see PUT_LUA)
            keys += [self.keys.data(h), *(self.keys.session(s) for s in sids)]
            args[5:7] = [1, data]
        # cluster: the value before its entry, so an entry never names a value not yet written
        elif self.link.call(lambda cl: cl.set(self.keys.data(h), data, px=self.ttl_ms)) is None:
            self.stats.add(dropped_writes=1)
            return
        swept = self.link.call(lambda cl: self._eval(cl, PUT_LUA, keys, args))
        if swept is None:  # the value alone is unreachable; it expires with its TTL
            self.stats.add(dropped_writes=1)
            return
        if self.link.cluster and sids:
            self._add_to_sessions(root, [h], sids)
        self.stats.add(num_writes=1, bytes_written=len(data), num_swept=len(swept))
        if self.evictions is not None:  # unused for a TTL: a later miss can say "evicted"
            for x in swept:
                self.evictions.note(BlockHash(x[:16]), BlockHash(x[16:32]), self.name)
        self._note_roots([meta])

    def _tag_now(self, tag: Tag) -> None:
        m, _, _, t = self.keys.namespace(tag.root)
        sets = [] if self.link.cluster else [self.keys.session(s) for s in tag.sids]
        args = [self.ttl_ms, tag.root, MAX_SESSIONS_PER_BLOCK, len(tag.sids), *tag.sids,
                *tag.hashes]  # fmt: skip
        done = self.link.call(lambda cl: self._eval(cl, TAG_LUA, [m, t, *sets], args))
        if done and self.link.cluster:
            self._add_to_sessions(tag.root, [BlockHash(x) for x in done], tag.sids)

    def _add_to_sessions(self, root: BlockHash, hashes: list[BlockHash], sids: list[bytes]) -> None:
        """Cluster mode: the session sets lie in other slots than the namespace's tags."""

        def run(cl: Any) -> None:
            for s in sids:
                k = self.keys.session(s)
                cl.sadd(k, *(root + h for h in hashes))
                cl.pexpire(k, self.ttl_ms)

        self.link.call(run)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and touch is done; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.002)
        return False
