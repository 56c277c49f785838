"""Session tags, TTL hints and subtrees in the SSD index (``IndexSessions``, a part of
``SsdIndex`` over its connection). Tags and TTLs are rows only for indexed blocks (``INSERT ... WHERE EXISTS``) and
go with their block (``SsdIndex.delete``), so the tables never outlive what they describe.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from promptcache.core.hashing import BlockHash
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK

if TYPE_CHECKING:
    from promptcache.core.tiers.ssd.index import Row

# a session tag or TTL only for a block the index holds; at most MAX_SESSIONS_PER_BLOCK tags
TAG_SQL = (
    "INSERT OR IGNORE INTO sessions (hash, session) SELECT ?1, ?2 "
    "WHERE EXISTS (SELECT 1 FROM blocks WHERE hash = ?1) "
    "AND (SELECT COUNT(*) FROM sessions WHERE hash = ?1) < ?3"
)
TTL_SQL = (
    "INSERT INTO ttls (hash, ttl) SELECT ?1, ?2 WHERE EXISTS (SELECT 1 FROM blocks WHERE hash = ?1) "
    "ON CONFLICT(hash) DO UPDATE SET ttl = max(ttl, excluded.ttl)"
)


class IndexSessions:
    """A part of ``SsdIndex``, over its connection and lock (given explicitly): tags, TTL
    hints, subtrees, expired rows."""

    def __init__(
        self,
        db: sqlite3.Connection,
        lock: threading.Lock,
        cols: str,
        row: Callable[[tuple[Any, ...]], Row],
        skey: Callable[[str], str],
        get: Callable[[BlockHash], Row | None],
    ) -> None:
        self._db = db
        self._lock = lock
        self._cols = cols  # the block columns ``row`` reads, in order
        self._row = row
        self._skey = skey  # a session id as stored (a keyed digest under a cipher)
        self.get = get

    def tag(self, hashes: list[BlockHash], session: str, ttl_s: float | None, now: float) -> None:
        """Record a use of these blocks (those indexed): last access, session tag, TTL hint."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE blocks SET last_access = ? WHERE hash = ?", [(now, h) for h in hashes]
            )
            if session:
                key = self._skey(session)
                self._db.executemany(TAG_SQL, [(h, key, MAX_SESSIONS_PER_BLOCK) for h in hashes])
            if ttl_s is not None:
                self._db.executemany(TTL_SQL, [(h, ttl_s) for h in hashes])

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        """Blocks tagged ``session`` -> whether another session is tagged on them too."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.hash, (SELECT COUNT(*) FROM sessions o WHERE o.hash = s.hash) "
                "FROM sessions s WHERE s.session = ?",
                (self._skey(session),),
            ).fetchall()
        return {BlockHash(h): n > 1 for h, n in rows}

    def session_totals(self) -> list[tuple[str, str, int, int, float | None]]:
        """(session as stored, tenant, blocks, file bytes, longest TTL hint) per session and
        tenant, most blocks first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.session, COALESCE(n.tenant, ''), COUNT(*), SUM(b.file_bytes), MAX(t.ttl) "
                "FROM sessions s JOIN blocks b ON b.hash = s.hash "
                "LEFT JOIN namespaces n ON n.root = b.root LEFT JOIN ttls t ON t.hash = s.hash "
                "GROUP BY s.session, n.tenant ORDER BY COUNT(*) DESC, s.session"
            ).fetchall()
        return [(str(a), str(t), int(n), int(b or 0), ttl) for a, t, n, b, ttl in rows]

    def forget_session(self, session: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE session = ?", (self._skey(session),))

    def subtree(self, hashes: Iterable[BlockHash]) -> list[Row]:
        """These blocks' rows and every row below them (children after parents)."""
        out: list[Row] = []
        seen: set[bytes] = set()
        todo = [self.get(h) for h in hashes]
        while todo:
            r = todo.pop()
            if r is None or r.block_hash in seen:
                continue
            seen.add(r.block_hash)
            out.append(r)
            with self._lock:
                kids = self._db.execute(
                    f"SELECT {self._cols} FROM blocks WHERE parent = ?", (r.block_hash,)
                ).fetchall()
            todo.extend(self._row(k) for k in kids)
        return out

    def rows_of_root(self, root: BlockHash) -> list[Row]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._cols} FROM blocks WHERE root = ?", (root,)
            ).fetchall()
        return [self._row(r) for r in rows]

    def expired(self, now: float) -> list[Row]:
        """Blocks whose TTL hint ran out: unused for longer than it by ``now``."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join('b.' + c for c in self._cols.split(', '))} FROM blocks b "
                "JOIN ttls t ON t.hash = b.hash WHERE b.last_access < ? - t.ttl",
                (now,),
            ).fetchall()
        return [self._row(r) for r in rows]

    def orphan_tags(self) -> int:
        """Session tags and TTLs of blocks the index no longer holds (always 0)."""
        with self._lock:
            (n,) = self._db.execute(
                "SELECT (SELECT COUNT(*) FROM sessions WHERE hash NOT IN (SELECT hash FROM blocks))"
                " + (SELECT COUNT(*) FROM ttls WHERE hash NOT IN (SELECT hash FROM blocks))"
            ).fetchone()
        return int(n)
