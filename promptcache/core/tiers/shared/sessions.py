"""The shared tier's half of the session protocol (``SharedSessions``, a part of ``ValkeyStore``).

Tags live on the server, so any server (or ``promptcache cache``) finds a session's blocks, even
blocks its own RAM and SSD never held: each block's session ids in its namespace's tags hash, and
each session's blocks (root + hash) in a set of its own (``index.Keys``). Both are written
by the put script with the block (standalone; cluster: the set right after) or by the tag script
(a hit, a touch), queued on the writer thread like every write. Session ids are digests of the
session key, which names the tenant: one tenant can never name another's session.

Expiry is Valkey's: a session set's TTL is refreshed whenever it gains a block and a tags hash
lives with its namespace's index, so tags go when the values they describe go (a swept entry
takes its tags). TTL hints (``5m``, ``1h``) do not shorten the tier's TTL: it is a floor that
several servers share. Members naming blocks gone since are ignored (their entry is checked).
"""

from __future__ import annotations

from typing import Any

from promptcache.core.block import BlockMeta
from promptcache.core.hashing import HASH_BYTES, BlockHash
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK, BlockUse
from promptcache.core.tiers.shared.context import SharedContext
from promptcache.core.tiers.shared.index import session_id
from promptcache.core.tiers.shared.scripts import UNTAG_LUA
from promptcache.core.tiers.shared.write import SharedWriter, Tag


class SharedSessions:
    """The shared tier's half of ``SessionAdmin`` (and ``delete_blocks``), over its context and its writer (tags
    are queued on the writer; deletions wait for its queue)."""

    def __init__(self, ctx: SharedContext, writer: SharedWriter) -> None:
        self.ctx = ctx
        self.writer = writer
        self.keys, self.link = ctx.keys, ctx.link

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        """Queued (the request path never waits on Valkey); blocks without an entry yet are
        skipped by the script (their put carries their tags). Without ``root``, each hash's
        root comes from this store's recent lookups and puts."""
        if not use.session or not hashes or not self.ctx.is_usable:
            return
        sid = session_id(use.session)
        for r, hs in self.ctx.group_by_root(hashes, root).items():
            self.writer.enqueue(Tag(r, hs, [sid]))

    def _members(self, session: str) -> dict[BlockHash, list[BlockHash]]:
        """The session's blocks by namespace root, as its set names them."""
        got = self.link.call(lambda cl: cl.smembers(self.keys.session(session_id(session))))
        by_root: dict[BlockHash, list[BlockHash]] = {}
        for x in got or ():
            if len(x) == 2 * HASH_BYTES:
                by_root.setdefault(BlockHash(x[:16]), []).append(BlockHash(x[16:]))
        return by_root

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        """Blocks still indexed that the session's set names -> whether another session's id
        is in their tags (or their tags are lost: then kept unless forced)."""
        self.writer.flush()  # queued puts and tags first
        sid = session_id(session)
        out: dict[BlockHash, bool] = {}
        found: list[BlockMeta] = []
        for root, hs in self._members(session).items():
            m, _, _, t = self.keys.namespace(root)

            def run(cl: Any, m: str = m, t: str = t, hs: list[BlockHash] = hs) -> Any:
                p = cl.pipeline(transaction=False)
                p.hmget(t, hs)
                for h in hs:
                    p.hexists(m, h)
                return p.execute()

            got = self.link.call(run)
            if got is None:
                continue
            for h, tags, exists in zip(hs, got[0], got[1:], strict=True):
                if not exists:
                    continue
                ids = {tags[i : i + 16] for i in range(0, len(tags), 16)} if tags else set()
                out[h] = not ids or bool(ids - {sid}) or len(ids) >= MAX_SESSIONS_PER_BLOCK
                found.append(BlockMeta(h, BlockHash(b""), root, b"", b"", 0))
        self.ctx.note_roots(found)  # so ``delete_blocks`` knows their namespaces
        return out

    def forget_session(self, session: str) -> None:
        """The session's id leaves the tags of the blocks that stay; its set goes."""
        self.writer.flush()
        sid = session_id(session)
        members = self._members(session)

        def run(cl: Any) -> None:
            for root, hs in members.items():
                self.ctx.eval(cl, UNTAG_LUA, [self.keys.tags(root)], [sid, *hs])
            cl.delete(self.keys.session(sid))

        self.link.call(run)

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """Values, entries and tags of the blocks whose namespace is known here (this
        process's lookups, puts and ``session_blocks``), with every block below them (found
        through the child lists). Bytes are not known here: (blocks, 0)."""
        self.writer.flush()
        by_root = self.ctx.group_by_root(hashes)
        metas: list[BlockMeta] = []
        for root, hs in by_root.items():
            entries = self.keys.index(root)[0]

            def run(cl: Any, entries: str = entries, hs: list[BlockHash] = hs) -> list[BlockHash]:
                return _subtree(cl, entries, hs)

            below = self.link.call(run)
            metas += [BlockMeta(h, BlockHash(b""), root, b"", b"", 0) for h in below or hs]
        self.ctx.delete(metas)
        return len(metas), 0

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        """Every value, the whole index and the tags of the namespace ``root``."""
        self.writer.flush()
        entries, _, recency, tags = self.keys.namespace(root)

        def run(cl: Any) -> int:
            hashes = [f for f in cl.hkeys(entries) if len(f) == HASH_BYTES]
            for h in hashes:  # one key per call: cluster-safe
                cl.delete(self.keys.data(h))
            cl.delete(entries, recency, tags)  # one hash tag: one slot
            return len(hashes)

        return int(self.link.call(run) or 0), 0

    def expire(self, now: float) -> int:
        return 0  # Valkey expires values, indexes and tags itself


def _subtree(cl: Any, entries: str, hashes: list[BlockHash]) -> list[BlockHash]:
    """``hashes`` and every block below them in one namespace, through its child lists."""
    by_parent: dict[bytes, list[bytes]] = {}
    for f in cl.hkeys(entries):
        if len(f) == HASH_BYTES + 4:
            by_parent.setdefault(f[:HASH_BYTES], []).append(f)
    out = list(dict.fromkeys(hashes))
    seen, frontier = set(out), out
    while frontier:
        fields = [f for h in frontier for f in by_parent.get(h, ())]
        if not fields:
            break
        frontier = []
        for kids in cl.hmget(entries, fields):
            for i in range(0, len(kids or b""), HASH_BYTES):
                k = BlockHash(kids[i : i + HASH_BYTES])
                if k not in seen:
                    seen.add(k)
                    frontier.append(k)
        out += frontier
    return out
