"""Shared tier: verified blocks on a Valkey (or Redis) server, found by chained hash.

Several servers pointing at the same Valkey see each other's blocks: a conversation that moves
from server A to server B still hits. Blocks are stored as the exact bytes of a block file
(``block_file.encode_block``: metadata + tensors + checksum); ``index`` has the key layout
and the chain lookup. Contract (what a tier adapter relies on):

A ``BlockStore`` (``core.tiers.base``) with feedback, session admin, stats, checks and a
warm-up source, registered as ``"shared"`` (``entry``):

- ``lookup(seq, start, parent, requires_checkpoint) -> list[StoredBlock]``: the core's one walk
  (``chain``) over entries fetched in one round trip (Lua) or two (pipelined); [] when down,
  slow or empty. Never raises.
- ``read(blocks) -> list[(payload, checkpoint) | CorruptBlockError]`` (``read``):
  one round trip, each value verified as it arrives (checksum, chained hash recomputed, model,
  root, the entry itself). A bad value is deleted with its entry and counted (``num_corrupt``; ``is_damage`` True); an expired
  or evicted one is a ``SharedBlockMissingError`` (``is_damage`` False), its entry dropped and
  the eviction noted in the ``EvictionLog``. Never raises.
- ``put(record) -> bool``: queued for the writer thread (bounded; full or down: dropped, counted).
- ``touch(hashes)``: a promotion from this tier (counted as a hit); queued, refreshes the values'
  TTL and the entries' recency (each hash's namespace root from a bounded map of recent lookups).

TTL and budget: every value has a TTL (``ttl_s``), refreshed by reads and touches; index entries
unused for a TTL are swept by later puts, and an abandoned namespace's index keys expire whole.
The byte budget is the server's: ``maxmemory`` with ``allkeys-lru`` (recommended; checked and
reported at connect). One process's own accounting could not hold a budget that several servers
share, while the server's LRU is exact, shared and free. An evicted value shows up as a missing
one at read (its entry dropped then); under ``noeviction`` a full server answers OOM, counted as
``oom_errors``, the write dropped. ``used_bytes()`` is the server's ``used_memory``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from promptcache.core.block import BlockMeta
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.figures import Series, Snapshot
from promptcache.core.hashing import BlockHash
from promptcache.core.tiers.base import StoredBlock
from promptcache.core.tiers.parts import PartsTier
from promptcache.core.tiers.shared.context import SharedContext
from promptcache.core.tiers.shared.index import Keys
from promptcache.core.tiers.shared.link import SharedStats, ValkeyLink
from promptcache.core.tiers.shared.read import (
    SharedBlockMissingError,
    SharedBlockRaceError,
    SharedReader,
)
from promptcache.core.tiers.shared.sessions import SharedSessions
from promptcache.core.tiers.shared.write import SharedWriter

log = logging.getLogger("promptcache.shared")
DEFAULT_TTL_S = 24 * 3600.0


class ValkeyStore(PartsTier):
    """A ``BlockStore`` composed of explicit parts over one ``SharedContext``: ``reader``
    (lookups, verified reads), ``writer`` (write-behind queue: puts, touches, tags; reconnects),
    ``sessions`` (session blocks, deletion)."""

    name = "shared"
    write_through = True
    reader: SharedReader
    writer: SharedWriter
    sessions: SharedSessions

    def __init__(
        self,
        url: str,
        model_fingerprint: str,
        *,
        codec: PayloadCodec | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        queue_blocks: int = 64,
        timeout_s: float = 0.5,
        retry_s: float = 0.25,
        lookup_mode: str = "lua",
        evictions: EvictionLog | None = None,
    ) -> None:
        """Never raises on an unreachable server (the writer thread keeps probing);
        ValueError on a URL that is not a Valkey one."""
        link = ValkeyLink(url, timeout_s=timeout_s, retry_s=retry_s)
        ttl_ms = max(1, int(ttl_s * 1000))
        self.ctx = SharedContext(model_fingerprint, link, codec or TreeCodec(), ttl_ms, evictions)
        self.reader = SharedReader(self.ctx, lookup_mode)
        self._tenants: dict[BlockHash, str] = {}
        self._server: dict[str, Any] = {}
        self._server_at = 0.0
        if link.probe():
            self._check_server()
        self.writer = SharedWriter(self.ctx, queue_blocks, self._check_server)
        self.sessions = SharedSessions(self.ctx, self.writer)

    # -- the context's facts, read by the checks, the CLI and tests --------------------------

    @property
    def model(self) -> str:
        return self.ctx.model

    @property
    def keys(self) -> Keys:
        return self.ctx.keys

    @property
    def link(self) -> ValkeyLink:
        return self.ctx.link

    @property
    def stats(self) -> SharedStats:
        return self.ctx.stats

    @property
    def codec(self) -> PayloadCodec:
        return self.ctx.codec

    @property
    def ttl_ms(self) -> int:
        return self.ctx.ttl_ms

    @property
    def lookup_mode(self) -> str:
        return self.reader.lookup_mode

    # -- LookupFeedback (the rest of BlockStore is the parts') -------------------------------

    def touch(self, hashes: Iterable[BlockHash], root: BlockHash | None = None) -> None:
        self.writer.touch(hashes, root)

    def refresh(self, hashes: Iterable[BlockHash], root: BlockHash | None = None) -> None:
        self.writer.refresh(hashes, root)

    def delete(self, metas: list[BlockMeta], data: bool = True) -> None:
        self.ctx.delete(metas, data)

    # -- SessionAdmin ------------------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        """Tenant names are for display only (the root is the key): kept in this process."""
        if len(self._tenants) < 4096:
            self._tenants[root] = tenant

    # -- server, checks, stats -------------------------------------------------------------

    def _check_server(self) -> None:
        info = self.server_info(max_age_s=0.0)
        policy = info.get("maxmemory_policy", "")
        if int(info.get("maxmemory", 0)) and policy == "noeviction":
            log.warning("shared tier: the server's maxmemory-policy is noeviction: once full, "
                        "writes fail (counted as oom_errors); allkeys-lru is recommended")  # fmt: skip

    def server_info(self, max_age_s: float = 1.0) -> dict[str, Any]:
        """The server's memory section of INFO (cached ``max_age_s``); {} when down."""
        if time.monotonic() - self._server_at > max_age_s:
            info = self.link.call(lambda cl: cl.info("memory"))
            stats = self.link.call(lambda cl: cl.info("stats"))
            if info is None:
                return {}
            if "used_memory" not in info and info:  # cluster: {node: section}, summed
                nodes = list(info.values())
                info = {"used_memory": sum(int(n.get("used_memory", 0)) for n in nodes),
                        "maxmemory": sum(int(n.get("maxmemory", 0)) for n in nodes),
                        "maxmemory_policy": nodes[0].get("maxmemory_policy", "")}  # fmt: skip
                stats = {}
            self._server = {**info, **{k: v for k, v in (stats or {}).items() if "_keys" in k}}
            self._server_at = time.monotonic()
        return self._server

    def used_bytes(self) -> int:
        return int(self.server_info().get("used_memory", 0))

    def check_integrity(self) -> None:
        """Writes flushed; then every index entry parses, sits in its parent's child list (and
        the lists name only entries), and its value, where still present, verifies and matches
        it; the server's memory stays within maxmemory (give or take one value). Nothing to
        check while down."""
        from promptcache.core.tiers.shared.check import check_store

        self.flush()
        check_store(self)

    def describe(self) -> Snapshot:
        info = self.server_info(max_age_s=0.1)
        counts, series = self.stats.figures()
        own = {"up": int(self.link.is_up), "retry_in_s": round(self.link.backoff.seconds_to_retry(), 3),
               "ttl_s": self.ttl_ms / 1000, "queued_writes": self.writer.queue.num_queued,
               "queued_write_bytes": self.queued_bytes(),
               "used_bytes": int(info.get("used_memory", 0)), "maxmemory": int(info.get("maxmemory", 0))}  # fmt: skip
        server = {"evicted_keys": int(info.get("evicted_keys", 0)),
                  "expired_keys": int(info.get("expired_keys", 0))}  # fmt: skip
        series += [Series(k, "gauge", v) for k, v in own.items()]
        series += [Series(k, "counter", v) for k, v in server.items()]
        texts = {"state": "connected" if self.link.is_up else "down", "url": self.link.url,
                 "lookup_mode": self.lookup_mode, "maxmemory_policy": info.get("maxmemory_policy", "")}  # fmt: skip
        return Snapshot({**counts, **own, **server, **texts}, tuple(series))

    # -- WarmSource ----------------------------------------------------------------------------

    def hottest_blocks(self, byte_budget: int, time_limit_s: float) -> list[StoredBlock]:
        from promptcache.core.tiers.shared.check import hottest_prefixes

        return [e.stored() for e in hottest_prefixes(self, byte_budget, time_limit_s)]

    def note_warmed(self, num_blocks: int, nbytes: int) -> None:
        self.stats.add(num_warmed_blocks=num_blocks, warmed_bytes=nbytes)

    def close(self) -> None:
        if self.ctx.is_closed:
            return
        self.flush(timeout=5.0)
        self.ctx.is_closed = True
        self.writer.close()
        self.link.close()


__all__ = ["SharedBlockMissingError", "SharedBlockRaceError", "ValkeyStore"]
