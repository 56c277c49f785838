"""What the shared tier's parts (reader, writer, sessions) share: one object, built by the store.

The link and its counters, the key layout, the codec, the values' TTL, the eviction log, and the
bounded map of block hash -> namespace root this process has seen (lookups, puts, a session's
blocks), so a touch, a tag or a deletion by hash alone finds its namespace's keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from valkey.exceptions import NoScriptError

from promptcache.core.block import BlockMeta
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import BlockHash
from promptcache.core.tiers.shared.index import Keys
from promptcache.core.tiers.shared.link import SharedStats, ValkeyLink
from promptcache.core.tiers.shared.scripts import DELETE_LUA, SHAS

MAX_ROOTS = 65536  # block hash -> namespace root, for touches by hash only; bounded


def run_script(client: Any, src: str, sha: str, keys: list[str], args: list[Any]) -> Any:
    try:
        return client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:  # a restarted (or new) server: EVAL loads it into the script cache
        return client.eval(src, len(keys), *keys, *args)


class SharedContext:
    name = "shared"  # the tier's name, for eviction notes

    def __init__(
        self,
        model: str,
        link: ValkeyLink,
        codec: PayloadCodec,
        ttl_ms: int,
        evictions: EvictionLog | None,
    ) -> None:
        self.model = model
        self.keys = Keys(model)
        self.link = link
        self.stats: SharedStats = link.stats
        self.codec = codec
        self.ttl_ms = ttl_ms
        self.evictions = evictions
        self.is_closed = False
        self._lock = threading.Lock()
        self._roots: OrderedDict[BlockHash, BlockHash] = OrderedDict()

    @property
    def is_usable(self) -> bool:
        """Open and connected: worth a round trip."""
        return not self.is_closed and self.link.is_up

    def note_roots(self, metas: Iterable[BlockMeta]) -> None:
        with self._lock:
            for m in metas:
                self._roots[m.block_hash] = m.root
                self._roots.move_to_end(m.block_hash)
            while len(self._roots) > MAX_ROOTS:
                self._roots.popitem(last=False)

    def group_by_root(
        self, hashes: Iterable[BlockHash], root: BlockHash | None = None
    ) -> dict[BlockHash, list[BlockHash]]:
        """``hashes`` by namespace root (``root`` for all, else each one's noted root; hashes
        of no known namespace are left out)."""
        groups: dict[BlockHash, list[BlockHash]] = {}
        with self._lock:
            for h in hashes:
                r = root or self._roots.get(h)
                if r is not None:
                    groups.setdefault(r, []).append(h)
        return groups

    def eval(self, client: Any, src: str, keys: list[str], args: list[Any]) -> Any:
        return run_script(client, src, SHAS[src], keys, args)

    def delete(self, metas: list[BlockMeta], data: bool = True) -> None:
        """Entries (and their values when ``data``) removed; best effort."""
        by_root: dict[BlockHash, list[bytes]] = {}
        for x in metas:
            by_root.setdefault(x.root, []).append(x.block_hash)

        def run(cl: Any) -> None:
            for root, hs in by_root.items():
                self.eval(cl, DELETE_LUA, self.keys.namespace(root), hs)
            if data:
                for x in metas:  # one key per call: cluster-safe (no cross-slot DEL)
                    cl.delete(self.keys.data(x.block_hash))

        self.link.call(run)
