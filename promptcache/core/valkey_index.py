"""Key layout, index entries and chain lookups of the shared (Valkey) tier.

Layout, for model fingerprint ``M`` (first 16 hex) and namespace root ``R`` (hex):

- ``pc:{M:R}:m`` HASH  block hash (16 raw bytes) -> packed ``SharedEntry`` (below), and
  parent hash + first token (20 bytes) -> child hashes, 16 bytes each. Entries and child lists
  share one key so that the server's LRU evicts a namespace's index whole or not at all (never
  child lists naming entries that are gone)
- ``pc:{M:R}:z`` ZSET  block hash -> last use (ms): recency for warm-up and the stale sweep
- ``pc:{M:H}:d`` STRING the block's verified bytes (``block_file.encode_block``), ``H`` its hash

A namespace's index keys share one hash tag, so in cluster mode they live in one slot and a Lua
script may touch all three; block data is tagged by its own hash, so data spreads over the
cluster (the index is ~1% of the bytes). The index is a hint, never trusted: reads verify the
data (checksum, chained hash, model, root) and compare it with the entry.

Lookups gather candidates in one round trip (``LOOKUP_LUA``: walk the expected hashes
server-side while each entry's parent is the previous hash, then fetch the children of the last
match under the next first token) or in two (pipelined: every expected entry and every possible
child list, then the lists the walk asks for). Either way the choice (tokens, extra keys, longest
common prefix, checkpoints) is the core's one walk (``chain.match_chain``/``checkpoint_path``)
over the fetched entries (``FoundIndex``): the same rules as RAM and SSD by construction.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from promptcache.core.block import BlockMeta
from promptcache.core.chain import checkpoint_path, match_chain
from promptcache.core.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tier import StoredBlock

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

    def index_pattern(self) -> str:
        """SCAN pattern of every namespace's entries hash of this model."""
        return self.prefix.replace("{", "\\{") + "*}:m"

    def root_of(self, entries_key: str | bytes) -> BlockHash:
        k = entries_key.decode() if isinstance(entries_key, bytes) else entries_key
        return BlockHash(bytes.fromhex(k[len(self.prefix) : k.index("}")]))


# KEYS: entries, child lists, recency[, value]. ARGV: hash, packed entry, now (ms), ttl (ms),
# sweep limit[, value]. With a value (standalone servers only: its key lies in another cluster
# slot) the value and its entry are written in one atomic step and one round trip; in cluster
# mode the writer SETs the value first. A new entry is added to its parent's child list. Then
# stale entries (unused for a ttl: their values have expired too) are swept, a few per put, and
# the index keys' TTL refreshed: an abandoned namespace's index expires with its values.
PUT_LUA = """
local m, c, z = KEYS[1], KEYS[2], KEYS[3]
local h, meta, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[6], 'PX', ttl) end
local function unlink(x, entry)
  local f = string.sub(entry, 1, 20)
  local kids = redis.call('HGET', c, f)
  if kids then
    local keep = {}
    for i = 1, #kids, 16 do
      local k = string.sub(kids, i, i + 15)
      if k ~= x then keep[#keep + 1] = k end
    end
    if #keep == 0 then redis.call('HDEL', c, f) else redis.call('HSET', c, f, table.concat(keep)) end
  end
end
local old = redis.call('HGET', m, h)
if old and string.sub(old, 1, 20) ~= string.sub(meta, 1, 20) then unlink(h, old); old = false end
redis.call('HSET', m, h, meta)
if not old then
  local f = string.sub(meta, 1, 20)
  local kids = redis.call('HGET', c, f) or ''
  local found = false
  for i = 1, #kids, 16 do
    if string.sub(kids, i, i + 15) == h then found = true; break end
  end
  if not found then redis.call('HSET', c, f, kids .. h) end
end
redis.call('ZADD', z, now, h)
local swept = 0
local stale = redis.call('ZRANGEBYSCORE', z, '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[5]))
for _, x in ipairs(stale) do
  local e = redis.call('HGET', m, x)
  if e then unlink(x, e); redis.call('HDEL', m, x) end
  redis.call('ZREM', z, x)
  swept = swept + 1
end
redis.call('PEXPIRE', m, ttl); redis.call('PEXPIRE', c, ttl); redis.call('PEXPIRE', z, ttl)
return swept
"""

# KEYS: entries, child lists, recency. ARGV: hashes. Removes entries (and their child links).
DELETE_LUA = """
local m, c, z = KEYS[1], KEYS[2], KEYS[3]
local n = 0
for _, h in ipairs(ARGV) do
  local e = redis.call('HGET', m, h)
  if e then
    local f = string.sub(e, 1, 20)
    local kids = redis.call('HGET', c, f)
    if kids then
      local keep = {}
      for i = 1, #kids, 16 do
        local k = string.sub(kids, i, i + 15)
        if k ~= h then keep[#keep + 1] = k end
      end
      if #keep == 0 then redis.call('HDEL', c, f) else redis.call('HSET', c, f, table.concat(keep)) end
    end
    redis.call('HDEL', m, h)
    n = n + 1
  end
  redis.call('ZREM', z, h)
end
return n
"""

# KEYS: entries, child lists. ARGV: parent, expected hashes (16 bytes each, concatenated), the
# first token (4 bytes each) at each block boundary from the start on. Returns
# {matched, h1, e1, ..., hk, ek, child1, centry1, ...}: the whole blocks whose entry names the
# previous hash as parent, then the children of the last under the next first token.
LOOKUP_LUA = """
local m, c = KEYS[1], KEYS[2]
local parent, hs, toks = ARGV[1], ARGV[2], ARGV[3]
local out = {0}
local i = 0
while i * 16 < #hs do
  local h = string.sub(hs, i * 16 + 1, i * 16 + 16)
  local e = redis.call('HGET', m, h)
  if not e or string.sub(e, 1, 16) ~= parent then break end
  out[#out + 1] = h; out[#out + 1] = e
  parent = h; i = i + 1
end
out[1] = i
local tok = string.sub(toks, i * 4 + 1, i * 4 + 4)
if #tok == 4 then
  local kids = redis.call('HGET', c, parent .. tok)
  if kids then
    for j = 1, #kids, 16 do
      local k = string.sub(kids, j, j + 15)
      local e = redis.call('HGET', m, k)
      if e then out[#out + 1] = k; out[#out + 1] = e end
    end
  end
end
return out
"""


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
