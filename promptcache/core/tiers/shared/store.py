"""Shared tier: verified blocks on a Valkey (or Redis) server, found by chained hash.

Several servers pointing at the same Valkey see each other's blocks: a conversation that moves
from server A to server B still hits. Blocks are stored as the exact bytes of a block file
(``block_file.encode_block``: metadata + tensors + checksum); ``valkey_index`` has the key layout
and the chain lookup. Contract (what a tier adapter relies on):

A ``LowerTier`` (``core.tiers.base``), registered as ``"shared"``:

- ``lookup(seq, start, parent, requires_checkpoint) -> list[StoredBlock]``: the core's one walk
  (``chain``) over entries fetched in one round trip (Lua) or two (pipelined); [] when down,
  slow or empty. Never raises.
- ``read(blocks) -> list[(payload, checkpoint) | CorruptBlockError]`` (``valkey_read``):
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

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from promptcache.core.block import BlockMeta
from promptcache.core.codec import PayloadCodec, TreeCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import BlockRecord, StoredBlock, register_tier
from promptcache.core.tiers.shared.index import (
    FoundIndex,
    Keys,
    SharedEntry,
    kid_field,
    lookup_args,
    parse_lookup,
    unpack_meta,
    walk,
)
from promptcache.core.tiers.shared.link import ValkeyLink
from promptcache.core.tiers.shared.read import (
    SharedBlockMissingError,
    SharedBlockRaceError,
    SharedReads,
)
from promptcache.core.tiers.shared.scripts import DELETE_LUA, LOOKUP_LUA, SHAS
from promptcache.core.tiers.shared.sessions import SharedSessions
from promptcache.core.tiers.shared.write import SharedWrites, Tag, Touch, run_script

log = logging.getLogger("promptcache.shared")
DEFAULT_TTL_S = 24 * 3600.0
MAX_ROOTS = 65536  # block hash -> namespace root, for touches by hash only; bounded


class ValkeyStore(SharedReads, SharedWrites, SharedSessions):
    name = "shared"
    write_through = True

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
        if lookup_mode not in ("lua", "pipeline"):
            raise ValueError(f"lookup_mode must be 'lua' or 'pipeline', got {lookup_mode!r}")
        self.model = model_fingerprint
        self.keys = Keys(model_fingerprint)
        self.codec = codec or TreeCodec()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.lookup_mode = lookup_mode
        self.link = ValkeyLink(url, timeout_s=timeout_s, retry_s=retry_s)
        self.evictions = evictions
        self.stats = self.link.stats
        self._lock = threading.Lock()
        self._roots: OrderedDict[BlockHash, BlockHash] = OrderedDict()
        self._tenants: dict[BlockHash, str] = {}
        self._server: dict[str, Any] = {}
        self._server_at = 0.0
        self._queue: queue.Queue[BlockRecord | Touch | Tag | None] = queue.Queue(
            maxsize=queue_blocks
        )
        self._closed = False
        if self.link.probe():
            self._check_server()
        self._writer = threading.Thread(target=self._loop, name="promptcache-shared", daemon=True)
        self._writer.start()

    # -- namespaces and roots ----------------------------------------------------------------

    def register_namespace(self, root: BlockHash, tenant: str) -> None:
        """Tenant names are for display only (the root is the key): kept in this process."""
        with self._lock:
            if len(self._tenants) < 4096:
                self._tenants[root] = tenant

    def _note_roots(self, metas: Iterable[BlockMeta]) -> None:
        with self._lock:
            for m in metas:
                self._roots[m.block_hash] = m.root
                self._roots.move_to_end(m.block_hash)
            while len(self._roots) > MAX_ROOTS:
                self._roots.popitem(last=False)

    def _eval(self, client: Any, src: str, keys: list[str], args: list[Any]) -> Any:
        return run_script(client, src, SHAS[src], keys, args)

    # -- lookups and reads (request path: bounded by the socket timeout, never raise) --------

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[StoredBlock]:
        if self._closed or not self.link.is_up or start * seq.block_size >= seq.num_tokens:
            return []
        hashes, toks = lookup_args(seq, start, parent)
        if self.lookup_mode == "lua":
            m, c, _ = self.keys.index(seq.root)
            reply = self.link.call(
                lambda cl: self._eval(cl, LOOKUP_LUA, [m, c], [parent, hashes, toks])
            )
            if reply is None:
                found: list[SharedEntry] = []
            else:
                chain, kids = parse_lookup(reply, seq.root)
                found = walk(FoundIndex([*chain, *kids]), seq, start, parent, requires_checkpoint)
        else:
            found = self._lookup_pipelined(seq, start, parent, hashes, toks, requires_checkpoint)
        self.stats.add(num_lookups=1, num_found=int(bool(found)))
        self._note_roots(e.meta for e in found)
        return [e.stored() for e in found]

    def _lookup_pipelined(
        self, seq: TokenSeq, start: int, parent: BlockHash, hashes: bytes, toks: bytes, rc: bool
    ) -> list[SharedEntry]:
        """Round trip 1: every expected entry and every possible child list; then the entries
        of each child list the walk asks for."""
        m, c, _ = self.keys.index(seq.root)
        hl = [hashes[i : i + 16] for i in range(0, len(hashes), 16)]
        parents = [parent, *hl]
        keys = [(BlockHash(parents[i]), int.from_bytes(toks[4 * i : 4 * i + 4], "little"))
                for i in range(len(toks) // 4)]  # fmt: skip
        fields = [kid_field(p, t) for p, t in keys]

        def first(cl: Any) -> Any:
            p = cl.pipeline(transaction=False)
            if hl:
                p.hmget(m, hl)
            if fields:
                p.hmget(c, fields)
            return p.execute()

        reply = self.link.call(first)
        if reply is None:
            return []
        entries, kid_lists = (reply[0], reply[1] if fields else []) if hl else ([], reply[0])
        lists = dict(zip(keys, kid_lists, strict=False))
        chain: list[SharedEntry] = []
        for h, e in zip(hl, entries, strict=True):
            meta = unpack_meta(h, seq.root, e) if e else None
            if meta is None:
                break
            chain.append(meta)

        def more(p: BlockHash, t: int) -> list[SharedEntry]:
            kids = lists.get((p, t))
            if not kids:
                return []
            ks = [kids[i : i + 16] for i in range(0, len(kids), 16)]
            got = self.link.call(lambda cl: cl.hmget(m, ks))
            found = [unpack_meta(k, seq.root, e) for k, e in zip(ks, got or [], strict=False) if e]
            return [x for x in found if x is not None]

        return walk(FoundIndex(chain, more), seq, start, parent, rc)

    def note_miss(self, failed: bool) -> None:
        self.stats.add(**{"promotion_failures" if failed else "num_misses": 1})

    def delete(self, metas: list[BlockMeta], data: bool = True) -> None:
        """Entries (and their values when ``data``) removed; best effort."""
        by_root: dict[BlockHash, list[bytes]] = {}
        for x in metas:
            by_root.setdefault(x.root, []).append(x.block_hash)

        def run(cl: Any) -> None:
            for root, hs in by_root.items():
                self._eval(cl, DELETE_LUA, self.keys.namespace(root), hs)
            if data:
                for x in metas:  # one key per call: cluster-safe (no cross-slot DEL)
                    cl.delete(self.keys.data(x.block_hash))

        self.link.call(run)

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

    def describe(self) -> dict[str, Any]:
        info = self.server_info(max_age_s=0.1)
        return {**self.stats.to_dict(), **self.link.describe(), "url": self.link.url,
                "lookup_mode": self.lookup_mode, "ttl_s": self.ttl_ms / 1000,
                "queued_writes": self._queue.qsize(), "used_bytes": int(info.get("used_memory", 0)),
                "maxmemory": int(info.get("maxmemory", 0)),
                "maxmemory_policy": info.get("maxmemory_policy", ""),
                "evicted_keys": int(info.get("evicted_keys", 0)),
                "expired_keys": int(info.get("expired_keys", 0))}  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self.flush(timeout=5.0)
        self._closed = True
        # a full queue: the writer is stuck on a slow server (a daemon thread: left behind)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5.0)
        self._writer.join(timeout=5.0)
        self.link.close()


register_tier("shared", ValkeyStore)

__all__ = ["SharedBlockMissingError", "SharedBlockRaceError", "ValkeyStore"]
