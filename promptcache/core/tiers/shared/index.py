"""Key layout, index entries and chain lookups of the shared (Valkey) tier.

Layout, for model fingerprint ``M`` (first 16 hex) and namespace root ``R`` (hex):

- ``pc:{M:R}:m`` HASH  block hash (16 raw bytes) -> packed ``SharedEntry`` (below), and
  parent hash + first token (20 bytes) -> child hashes, 16 bytes each. Entries and child lists
  share one key so that the server's LRU evicts a namespace's index whole or not at all (never
  child lists naming entries that are gone)
- ``pc:{M:R}:z`` ZSET  block hash -> last use (ms): recency for warm-up and the stale sweep
- ``pc:{M:R}:t`` HASH  block hash -> the ids of the sessions that used it (16 bytes each)
- ``pc:{M:H}:d`` STRING the block's verified bytes (``block_file.encode_block``), ``H`` its hash
- ``pc:{M:S}:s`` SET   session ``S`` (``session_id``: tenant + id, digested) -> root + block
  hash of every block it used (32 bytes each): how a server that never saw the session finds it

A namespace's index keys share one hash tag, so in cluster mode they live in one slot and a Lua
script may touch all three; block data is tagged by its own hash, so data spreads over the
cluster (the index is ~1% of the bytes). The index is a hint, never trusted: reads verify the
data (checksum, chained hash, model, root) and compare it with the entry.

The scripts are in ``scripts``. Lookups gather candidates in one round trip (``LOOKUP_LUA``: walk the expected hashes
server-side while each entry's parent is the previous hash, then fetch the children of the last
match under the next first token) or in two (pipelined: every expected entry and every possible
child list, then the lists the walk asks for). Either way the choice (tokens, extra keys, longest
common prefix, checkpoints) is the core's one walk (``chain.match_chain``/``checkpoint_path``)
over the fetched entries (``FoundIndex``): the same rules as RAM and SSD by construction.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from promptcache.core.block import BlockMeta
from promptcache.core.chain import checkpoint_path, match_chain
from promptcache.core.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import StoredBlock

# parent | first token | depth | flags | data bytes | payload bytes | extra length; extra; tokens.
# The parent + first token lead, so a Lua script reads an entry's child-list field as sub(1, 20).
_HEAD = struct.Struct("<16sIIBQQI")
KID_FIELD_BYTES = HASH_BYTES + TOKEN_BYTES
_CKPT, _SEQ_END = 1, 2


class SharedEntry(NamedTuple):
    """One index entry of the shared tier: the block's identity (``BlockMeta``), this copy's
    state as a ``StoredBlock`` carries it, and the stored (encoded) size. A ``chain.ChainEntry``."""

    meta: BlockMeta
    nbytes: int  # payload + checkpoint bytes once read back
    has_checkpoint: bool
    is_seq_end: bool
    data_bytes: int  # the stored (encoded) bytes

    @property
    def block_hash(self) -> BlockHash:
        return self.meta.block_hash

    def stored(self) -> StoredBlock:
        return StoredBlock(self.meta, self.nbytes, self.has_checkpoint, self.is_seq_end)


def pack_meta(e: SharedEntry) -> bytes:
    m = e.meta
    flags = (_CKPT if e.has_checkpoint else 0) | (_SEQ_END if e.is_seq_end else 0)
    head = _HEAD.pack(
        m.parent_hash, m.first_token, m.depth, flags, e.data_bytes, e.nbytes, len(m.extra)
    )
    return head + m.extra + m.token_bytes


def unpack_meta(block_hash: bytes, root: BlockHash, data: bytes) -> SharedEntry | None:
    """The entry, or None when it does not parse (a damaged entry is a miss, never an error)."""
    if len(data) < _HEAD.size:
        return None
    parent, first, depth, flags, dbytes, pbytes, nextra = _HEAD.unpack_from(data)
    extra = data[_HEAD.size : _HEAD.size + nextra]
    tokens = data[_HEAD.size + nextra :]
    if len(extra) != nextra or not tokens or len(tokens) % TOKEN_BYTES or len(block_hash) != 16:
        return None
    if int.from_bytes(tokens[:TOKEN_BYTES], "little") != first:
        return None
    meta = BlockMeta(BlockHash(bytes(block_hash)), BlockHash(parent), root, tokens, extra, depth)
    return SharedEntry(meta, pbytes, bool(flags & _CKPT), bool(flags & _SEQ_END), dbytes)


def session_id(session: str) -> bytes:
    """A session key (``sessions.session_key``: tenant and id) as 16 bytes in keys and tags."""
    return hashlib.sha256(session.encode()).digest()[:16]


def kid_field(parent: bytes, first_token: int) -> bytes:
    return parent + first_token.to_bytes(TOKEN_BYTES, "little")


class Keys:
    """Key names of one model (``model`` the full fingerprint; keys use its first 16 hex)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.prefix = f"pc:{{{model[:16]}:"

    def index(self, root: bytes) -> tuple[str, str, str]:
        """(entries, child lists, recency) of a namespace: one hash tag, one cluster slot. The
        first two are the same key (see the module docstring); scripts take them apart."""
        tag = f"{self.prefix}{root.hex()}}}"
        return tag + ":m", tag + ":m", tag + ":z"

    def data(self, block_hash: bytes) -> str:
        return f"{self.prefix}{block_hash.hex()}}}:d"

    def namespace(self, root: bytes) -> list[str]:
        """Every key of a namespace's index (entries = child lists, recency, tags)."""
        m, _, z = self.index(root)
        return [m, m, z, self.tags(root)]

    def tags(self, root: bytes) -> str:
        """A namespace's session tags: block hash -> session ids (``session_id``), 16 bytes
        each; in the namespace's slot, so the put script writes a block's tags with it."""
        return f"{self.prefix}{root.hex()}}}:t"

    def session(self, sid: bytes) -> str:
        """One session's blocks: a SET of namespace root + block hash (32 bytes each)."""
        return f"{self.prefix}{sid.hex()}}}:s"

    def index_pattern(self) -> str:
        """SCAN pattern of every namespace's entries hash of this model."""
        return self.prefix.replace("{", "\\{") + "*}:m"

    def root_of(self, entries_key: str | bytes) -> BlockHash:
        k = entries_key.decode() if isinstance(entries_key, bytes) else entries_key
        return BlockHash(bytes.fromhex(k[len(self.prefix) : k.index("}")]))


def lookup_args(seq: TokenSeq, start: int, parent: BlockHash) -> tuple[bytes, bytes]:
    """(expected hashes, first tokens at each boundary from ``start``) for ``LOOKUP_LUA``."""
    b, n = seq.block_size, seq.num_tokens
    hashes = b"".join(seq.block_hash(i) for i in range(start, seq.num_full_blocks))
    toks = b"".join(seq.block_bytes(i * b, i * b + 1) for i in range(start, (n - 1) // b + 1))
    return hashes, toks


def parse_lookup(reply: list[Any], root: BlockHash) -> tuple[list[SharedEntry], list[SharedEntry]]:
    """``LOOKUP_LUA``'s reply -> (whole-block entries in order, tail candidates)."""
    matched = int(reply[0])
    pairs = [unpack_meta(reply[i], root, reply[i + 1]) for i in range(1, len(reply) - 1, 2)]
    chain = [p for p in pairs[:matched] if p is not None]
    if len(chain) < matched:  # a damaged entry: the chain ends before it
        chain = chain[: next(i for i, p in enumerate(pairs[:matched]) if p is None)]
        return chain, []
    return chain, [p for p in pairs[matched:] if p is not None]


class FoundIndex:
    """What a lookup fetched, as a ``chain.BlockIndex``: entries by hash, children by parent
    hash + first token (the chain's entries are their parents' children too). ``more(p, t)``
    fetches a child list the reply did not carry (the pipelined lookup's second round trip);
    without it such a list is empty. The walk (``chain``) verifies everything: the server-side
    loop only gathers candidates."""

    def __init__(
        self,
        entries: Iterable[SharedEntry],
        more: Callable[[BlockHash, int], list[SharedEntry]] | None = None,
    ) -> None:
        self._by_hash: dict[BlockHash, SharedEntry] = {}
        self._kids: dict[tuple[BlockHash, int], list[SharedEntry]] = {}
        self._more = more
        self._fetched: set[tuple[BlockHash, int]] = set()
        self.add(entries)

    def add(self, entries: Iterable[SharedEntry]) -> None:
        for e in entries:
            m = e.meta
            if m.block_hash in self._by_hash:
                continue
            self._by_hash[m.block_hash] = e
            self._kids.setdefault((m.parent_hash, m.first_token), []).append(e)

    def get(self, block_hash: BlockHash, /) -> SharedEntry | None:
        return self._by_hash.get(block_hash)

    def children(self, parent: BlockHash, first_token: int, /) -> list[SharedEntry]:
        key = (parent, first_token)
        if self._more is not None and key not in self._fetched:
            self._fetched.add(key)
            self.add(self._more(parent, first_token))
        return self._kids.get(key, [])


def walk(
    index: FoundIndex, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool
) -> list[SharedEntry]:
    """The RAM and SSD tiers' walk (``chain.match_chain``; with ``requires_checkpoint``,
    ``chain.checkpoint_path``) over what a lookup fetched."""
    full, tail, _ = match_chain(index, seq, start, parent)
    if requires_checkpoint:
        return checkpoint_path(index, seq, start, parent, full)
    return full if tail is None else [*full, tail]
