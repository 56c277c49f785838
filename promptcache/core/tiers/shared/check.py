"""Whole-store walks of the shared tier: the integrity check and the warm-up list (the warm-up
itself is ``tiers.warm``, on any ``WarmSource``).

Both read every namespace index of one model (SCAN; in cluster mode on every primary). An index
is ~1% of the bytes it describes, so reading it whole is cheap next to pulling the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from promptcache.core.block_file import CorruptBlockError
from promptcache.core.hashing import BlockHash
from promptcache.core.tiers.shared.index import KID_FIELD_BYTES, SharedEntry, kid_field, unpack_meta

if TYPE_CHECKING:
    from promptcache.core.tiers.shared.store import ValkeyStore


def roots(store: ValkeyStore) -> list[BlockHash]:
    """Namespace roots of this model that have an index on the server ([] when down)."""
    got = store.link.call(
        lambda cl: list(cl.scan_iter(match=store.keys.index_pattern(), count=1000))
    )
    return sorted({store.keys.root_of(k) for k in got or []})


def namespace_index(
    store: ValkeyStore, root: BlockHash
) -> tuple[dict[BlockHash, SharedEntry | None], dict[bytes, bytes], dict[bytes, float]]:
    """(entries by hash (None: unparsable), child lists, recency) of one namespace."""
    m, _, z = store.keys.index(root)

    def run(cl: Any) -> Any:
        p = cl.pipeline(transaction=False)
        p.hgetall(m)
        p.zrange(z, 0, -1, withscores=True)
        return p.execute()

    got = store.link.call(run)
    if got is None:
        return {}, {}, {}
    # entries have 16-byte fields, child lists 20-byte ones (the same hash: see index.py)
    entries = {BlockHash(h): unpack_meta(h, root, e) for h, e in got[0].items() if len(h) == 16}
    kids = {f: v for f, v in got[0].items() if len(f) == KID_FIELD_BYTES}
    return entries, kids, {h: s for h, s in got[1]}


def _hgetall(key: str) -> Callable[[Any], Any]:
    return lambda cl: cl.hgetall(key)


def _getter(key: str) -> Callable[[Any], Any]:
    return lambda cl: cl.get(key)


def check_store(store: ValkeyStore) -> None:
    """See ``ValkeyStore.check_integrity``; raises AssertionError."""
    if not store.link.is_up:
        return
    largest = 0
    for root in roots(store):
        entries, kids, _ = namespace_index(store, root)
        for h, meta in entries.items():
            assert meta is not None, f"unparsable index entry {h.hex()}"
            f = kid_field(meta.meta.parent_hash, meta.meta.first_token)
            listed = kids.get(f, b"")
            assert any(listed[i : i + 16] == h for i in range(0, len(listed), 16)), (
                f"{h.hex()} missing from its parent's child list"
            )
            largest = max(largest, meta.data_bytes)
        for f, listed in kids.items():
            for i in range(0, len(listed), 16):
                k = BlockHash(listed[i : i + 16])
                meta = entries.get(k)
                assert meta is not None, f"child list names {k.hex()}, not indexed"
                assert kid_field(meta.meta.parent_hash, meta.meta.first_token) == f, (
                    "child under a wrong parent"
                )
        tagged = store.link.call(_hgetall(store.keys.tags(root))) or {}
        for h, ids in tagged.items():  # session tags only on indexed blocks
            assert h in entries, f"session tags on {h.hex()}, not indexed"
            assert ids and len(ids) % 16 == 0, f"bad session tags on {h.hex()}"
        metas = [m for m in entries.values() if m is not None]
        for meta in metas:
            value = store.link.call(_getter(store.keys.data(meta.block_hash)))
            if value is None:
                continue  # expired or evicted: dropped from the index at its next read
            try:
                store.reader.verify(meta.stored(), value)
            except CorruptBlockError as exc:
                raise AssertionError(f"{meta.block_hash.hex()}: {exc}") from None
    info = store.server_info(max_age_s=0.0)
    cap = int(info.get("maxmemory", 0))
    if cap:
        used = int(info.get("used_memory", 0))
        assert used <= cap + largest + 2**20, f"server holds {used} bytes, maxmemory {cap}"


def hottest_prefixes(
    store: ValkeyStore,
    byte_budget: int,
    time_limit_s: float = 5.0,
    namespace_roots: list[BlockHash] | None = None,
) -> list[SharedEntry]:
    """The most recently used blocks of this model, each with every ancestor (a block is only
    usable after its parent), within ``byte_budget`` stored bytes, in parent-before-child
    order; for a new server to pull (``store.read``) before its first request. Stops at
    ``time_limit_s`` with what it has; [] when down."""
    deadline = time.monotonic() + time_limit_s
    scored: list[tuple[float, SharedEntry]] = []
    by_hash: dict[BlockHash, SharedEntry] = {}
    for root in roots(store) if namespace_roots is None else namespace_roots:
        if time.monotonic() > deadline:
            break
        entries, _, recency = namespace_index(store, root)
        for h, meta in entries.items():
            if meta is not None:
                by_hash[h] = meta
                scored.append((recency.get(h, 0.0), meta))
    scored.sort(key=lambda t: -t[0])
    chosen: dict[BlockHash, SharedEntry] = {}
    spent = 0
    for _, meta in scored:
        if time.monotonic() > deadline:
            break
        need: list[SharedEntry] = []
        x: SharedEntry | None = meta
        while x is not None and x.block_hash not in chosen:
            need.append(x)
            if x.meta.depth == 0:
                break
            x = by_hash.get(x.meta.parent_hash)
        if x is None:
            continue  # an ancestor is gone: unreachable, not worth pulling
        cost = sum(n.data_bytes for n in need)
        if need and spent + cost <= byte_budget:
            spent += cost
            for n in need:
                chosen[n.block_hash] = n
    return sorted(chosen.values(), key=lambda m: m.meta.depth)
