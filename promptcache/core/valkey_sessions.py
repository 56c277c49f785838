"""The shared tier's half of the session protocol (a mixin of ``ValkeyStore``).

The shared tier keeps no session tags: a session's blocks are found through RAM's and the SSD's
tags and deleted here by hash; a whole namespace goes with its index; expiry is Valkey's own TTL
on every value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from promptcache.core.block import BlockMeta
from promptcache.core.hashing import HASH_BYTES, BlockHash
from promptcache.core.sessions import BlockUse
from promptcache.core.valkey_index import Keys
from promptcache.core.valkey_link import ValkeyLink


class SharedSessions:
    """Needs the store's lock, hash -> root map, keys, link, ``flush`` and ``delete``."""

    _lock: threading.Lock
    _roots: OrderedDict[BlockHash, BlockHash]
    keys: Keys
    link: ValkeyLink

    def flush(self, timeout: float = 30.0) -> bool:
        raise NotImplementedError

    def delete(self, metas: list[BlockMeta], data: bool = True) -> None:
        raise NotImplementedError

    def tag(self, hashes: list[BlockHash], use: BlockUse, now: float) -> None:
        pass

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        return {}

    def forget_session(self, session: str) -> None:
        pass

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """Values and entries of the blocks whose namespace this process has seen (the
        hash -> root map); blocks below them lose their parent entry, so no lookup reaches
        them, and expire with their TTL. Bytes are not known here: (blocks, 0)."""
        with self._lock:
            known = [(h, self._roots[h]) for h in hashes if h in self._roots]
        self.flush()
        metas = [BlockMeta(h, BlockHash(b""), root, b"", b"", 0) for h, root in known]
        self.delete(metas)
        return len(metas), 0

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        """Every value and the whole index of the namespace ``root``."""
        self.flush()
        entries, _, recency = self.keys.index(root)

        def run(cl: Any) -> int:
            hashes = [f for f in cl.hkeys(entries) if len(f) == HASH_BYTES]
            for h in hashes:  # one key per call: cluster-safe
                cl.delete(self.keys.data(h))
            cl.delete(entries, recency)  # one hash tag: one slot
            return len(hashes)

        return int(self.link.call(run) or 0), 0

    def expire(self, now: float) -> int:
        return 0
