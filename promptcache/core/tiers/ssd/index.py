"""SQLite index of the SSD tier (WAL mode): hash -> parent, tokens, file, sizes, access times.

Lookups walk the chain here without reading tensor data. All methods are thread-safe.
A namespace (tenant) record lives exactly as long as its namespace has a block: it is written
with the first block and deleted with the last.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from promptcache.core.block import META_COLUMNS, BlockMeta
from promptcache.core.cipher import BlockCipher, CipherError
from promptcache.core.hashing import BlockHash
from promptcache.core.private_fs import FILE_MODE, open_private, tighten
from promptcache.core.sessions import MAX_SESSIONS_PER_BLOCK
from promptcache.core.tiers.ssd.index_sessions import TAG_SQL, TTL_SQL, IndexSessions

# 2: rows of block format 2 only. An index of another version is dropped at open, so start-up
# re-checks every file (old-format files among them are never served)
INDEX_VERSION = 2
TENANT_MAX_CHARS = 256  # the name is for display (stats, ls); the namespace root is the key

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    hash BLOB PRIMARY KEY,
    parent BLOB NOT NULL,
    root BLOB NOT NULL,
    tokens BLOB NOT NULL,
    extra BLOB NOT NULL,
    first_token INTEGER NOT NULL,
    depth INTEGER NOT NULL,
    path TEXT NOT NULL,
    file_bytes INTEGER NOT NULL,
    payload_nbytes INTEGER NOT NULL,
    has_checkpoint INTEGER NOT NULL,
    is_seq_end INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_children ON blocks(parent, first_token);
CREATE INDEX IF NOT EXISTS blocks_access ON blocks(last_access);
CREATE INDEX IF NOT EXISTS blocks_root ON blocks(root);
CREATE TABLE IF NOT EXISTS namespaces (root BLOB PRIMARY KEY, tenant TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    hash BLOB NOT NULL, session TEXT NOT NULL, PRIMARY KEY (hash, session)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sessions_by_session ON sessions(session);
CREATE TABLE IF NOT EXISTS ttls (hash BLOB PRIMARY KEY, ttl REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Row(NamedTuple):
    """One indexed block: its identity plus where and how its file is stored."""

    meta: BlockMeta
    path: str  # relative to the model folder
    file_bytes: int
    payload_nbytes: int
    has_checkpoint: bool
    is_seq_end: bool
    created: float
    last_access: float

    @property
    def block_hash(self) -> BlockHash:
        return self.meta.block_hash


_META_COLS = ", ".join(META_COLUMNS.values())
_LOCATION_COLS = (
    "path, file_bytes, payload_nbytes, has_checkpoint, is_seq_end, created, last_access"
)
_COLS = f"{_META_COLS}, {_LOCATION_COLS}"
_NUM_META = len(META_COLUMNS)
_TOKENS = list(META_COLUMNS).index("token_bytes")
_EXTRA = list(META_COLUMNS).index("extra")
# first_token is derived from the tokens; stored only for the children index
_INSERT = (
    f"INSERT OR REPLACE INTO blocks ({_COLS}, first_token) "
    f"VALUES ({','.join('?' * (_NUM_META + len(Row._fields)))})"
)


def _row(r: tuple[Any, ...] | list[Any]) -> Row:
    path, file_bytes, payload_nbytes, has_ckpt, seq_end, created, last_access = r[_NUM_META:]
    return Row(
        BlockMeta(*r[:_NUM_META]),
        path,
        file_bytes,
        payload_nbytes,
        bool(has_ckpt),
        bool(seq_end),
        created,
        last_access,
    )


class SsdIndex:
    """With a ``cipher`` the index holds no token ids: tokens and extra keys are encrypted
    (bound to the block's hash), the children index keys on a keyed digest of the first token,
    session ids are keyed digests. The chain walk still works: rows are found by hash or by
    (parent, digest of the first token) and their tokens compared after decrypting. The key's
    id is kept in ``settings``: an index written under another key (or none) is emptied at
    open, so start-up re-checks every file, and files that do not decrypt are quarantined."""

    def __init__(
        self, path: Path, cipher: BlockCipher | None = None, adopt_key: bool = True
    ) -> None:
        """``adopt_key``: the tier's open (an index of another key is emptied); False for the
        ``cache`` commands, which only read ``stored_key_id`` and never empty anything."""
        self.cipher = cipher
        self._cols = _COLS
        # created 0600 first: SQLite gives its -wal and -shm files the database file's mode
        os.close(open_private(path, os.O_RDWR))
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        if self._db.execute("PRAGMA user_version").fetchone()[0] != INDEX_VERSION:
            self._db.executescript(
                "DROP TABLE IF EXISTS blocks; DROP TABLE IF EXISTS namespaces; "
                "DROP TABLE IF EXISTS sessions; DROP TABLE IF EXISTS ttls;"
            )
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
        if adopt_key:
            self._check_key()
        self.sessions = IndexSessions(self._db, self._lock, _COLS, self._row, self._skey, self.get)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                tighten(side, FILE_MODE)

    def stored_key_id(self) -> str:
        """The id of the key the rows were written under ("": none, plaintext)."""
        with self._lock:
            r = self._db.execute("SELECT value FROM settings WHERE key = 'key_id'").fetchone()
        return str(r[0]) if r else ""

    def _check_key(self) -> None:
        key_id = self.cipher.key_id if self.cipher is not None else ""
        if self.stored_key_id() != key_id:
            self.clear()  # rows of another key (or plaintext): re-indexed from the files
        self._db.execute(
            "INSERT OR REPLACE INTO settings (key, value) VALUES ('key_id', ?)", (key_id,)
        )

    def _row(self, r: tuple[Any, ...]) -> Row:
        c = self.cipher
        if c is None:
            return _row(r)
        values = list(r)
        for i in (_TOKENS, _EXTRA):
            try:
                values[i] = c.open(values[i], values[0]) if values[i] else b""
            except CipherError:
                values[i] = b""  # an altered row matches no prompt: never served
        return _row(values)

    def _seal(self, meta: BlockMeta) -> tuple[Any, ...]:
        """Index values of ``meta`` (+ first_token last) as stored: sealed with a cipher."""
        c = self.cipher
        if c is None:
            return (*meta, meta.first_token)
        h = meta.block_hash
        extra = c.seal(meta.extra, h) if meta.extra else b""
        values = (h, meta.parent_hash, meta.root, c.seal(meta.token_bytes, h), extra, meta.depth)
        return (*values, c.token_tag(meta.first_token))

    def _skey(self, session: str) -> str:
        return self.cipher.name_tag(session) if self.cipher is not None else session

    # -- sessions, TTL hints, subtrees: the ``IndexSessions`` part's --------------------------

    def tag(self, hashes: list[BlockHash], session: str, ttl_s: float | None, now: float) -> None:
        self.sessions.tag(hashes, session, ttl_s, now)

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        return self.sessions.session_blocks(session)

    def session_totals(self) -> list[tuple[str, str, int, int, float | None]]:
        return self.sessions.session_totals()

    def forget_session(self, session: str) -> None:
        self.sessions.forget_session(session)

    def subtree(self, hashes: Iterable[BlockHash]) -> list[Row]:
        return self.sessions.subtree(hashes)

    def rows_of_root(self, root: BlockHash) -> list[Row]:
        return self.sessions.rows_of_root(root)

    def expired(self, now: float) -> list[Row]:
        return self.sessions.expired(now)

    def orphan_tags(self) -> int:
        return self.sessions.orphan_tags()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, block_hash: BlockHash) -> Row | None:
        with self._lock:
            r = self._db.execute(
                f"SELECT {_COLS} FROM blocks WHERE hash = ?", (block_hash,)
            ).fetchone()
        return self._row(r) if r else None

    def children(self, parent: BlockHash, first_token: int) -> list[Row]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM blocks WHERE parent = ? AND first_token = ?",
                (
                    parent,
                    first_token if self.cipher is None else self.cipher.token_tag(first_token),
                ),
            ).fetchall()
        return [self._row(r) for r in rows]

    def upsert(
        self,
        row: Row,
        tenant: str = "",
        sessions: Iterable[str] = (),
        ttl_s: float | None = None,
    ) -> None:
        """The block's row (with its session tags and TTL hint), and its namespace's record
        when this is the namespace's first."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            *meta, first = self._seal(row.meta)
            self._db.execute(_INSERT, (*meta, *row[1:], first))
            self._db.execute(
                "INSERT OR IGNORE INTO namespaces (root, tenant) VALUES (?, ?)",
                (row.meta.root, tenant[:TENANT_MAX_CHARS]),
            )
            h = row.block_hash
            self._db.executemany(
                TAG_SQL, [(h, self._skey(s), MAX_SESSIONS_PER_BLOCK) for s in sessions]
            )
            if ttl_s is not None:
                self._db.execute(TTL_SQL, (h, ttl_s))

    def delete(self, hashes: Iterable[BlockHash]) -> None:
        """Delete these blocks, and the record of any namespace left without a block."""
        keys = [(h,) for h in hashes]
        if not keys:
            return
        with self._lock, self._db:
            self._db.execute("BEGIN")
            roots = set()
            for (h,) in keys:
                r = self._db.execute("SELECT root FROM blocks WHERE hash = ?", (h,)).fetchone()
                if r is not None:
                    roots.add(r[0])
            self._db.executemany("DELETE FROM blocks WHERE hash = ?", keys)
            self._db.executemany("DELETE FROM sessions WHERE hash = ?", keys)
            self._db.executemany("DELETE FROM ttls WHERE hash = ?", keys)
            self._db.executemany(
                "DELETE FROM namespaces WHERE root = ? AND NOT EXISTS "
                "(SELECT 1 FROM blocks WHERE blocks.root = namespaces.root)",
                [(r,) for r in roots],
            )

    def prune_namespaces(self) -> int:
        """Delete records of namespaces without a block (left by an older version)."""
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM namespaces WHERE NOT EXISTS "
                "(SELECT 1 FROM blocks WHERE blocks.root = namespaces.root)"
            )
            return cur.rowcount

    def touch(self, hashes: Iterable[BlockHash], now: float) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE blocks SET last_access = ? WHERE hash = ?", [(now, h) for h in hashes]
            )

    def all_rows(self) -> list[Row]:
        with self._lock:
            return [
                self._row(r) for r in self._db.execute(f"SELECT {_COLS} FROM blocks").fetchall()
            ]

    def totals(self) -> tuple[int, int]:
        """(number of blocks, file bytes)."""
        with self._lock:
            n, b = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(file_bytes), 0) FROM blocks"
            ).fetchone()
        return int(n), int(b)

    def lru_leaves(self, limit: int) -> list[Row]:
        """Least recently used blocks that no other indexed block names as parent."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM blocks b WHERE NOT EXISTS (SELECT 1 FROM blocks c WHERE c.parent = b.hash) "
                "ORDER BY last_access LIMIT ?",
                (limit,),
            ).fetchall()
        return [self._row(r) for r in rows]

    def older_than(self, cutoff: float) -> list[Row]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM blocks WHERE last_access < ?", (cutoff,)
            ).fetchall()
        return [self._row(r) for r in rows]

    def tenants(self) -> dict[BlockHash, str]:
        with self._lock:
            return {
                BlockHash(r): t
                for r, t in self._db.execute("SELECT root, tenant FROM namespaces").fetchall()
            }

    def clear(self) -> None:
        with self._lock:
            for table in ("blocks", "namespaces", "sessions", "ttls"):
                self._db.execute(f"DELETE FROM {table}")
