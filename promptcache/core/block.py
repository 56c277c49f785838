"""Resident block metadata and payload size accounting.

A block holds ``num_tokens`` (<= block_size) tokens of positional state (one slice per token)
and optionally a checkpoint: snapshot state (SSM state, sliding-window ring) valid exactly at
the block's end. Payloads are opaque, immutable and shared by reference, never copied to share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from promptcache.core.hashing import TOKEN_BYTES, BlockHash


def array_nbytes(arr: Any) -> int:
    """Bytes of an array from shape x dtype only: never materialises a lazy (MLX) array."""
    dtype = arr.dtype
    itemsize = getattr(dtype, "itemsize", None) or getattr(dtype, "size", None)
    if itemsize is None:
        raise TypeError(f"cannot size array with dtype {dtype!r}")
    return math.prod(arr.shape) * int(itemsize)


def payload_nbytes(payload: Any) -> int:
    """Bytes of a payload: arrays and bytes, nested in lists/tuples/dicts; other leaves count 0."""
    if payload is None:
        return 0
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    if isinstance(payload, list | tuple):
        return sum(payload_nbytes(p) for p in payload)
    if isinstance(payload, dict):
        return sum(payload_nbytes(p) for p in payload.values())
    if hasattr(payload, "shape") and hasattr(payload, "dtype"):
        return array_nbytes(payload)
    return 0  # scalars and small metadata (ints, flags, a device) are not counted


# A tier's clock advances this much per byte inserted and by one per use: time is bytes
# inserted (scale-free, the same in a sampled miniature), uses between two inserts still ordered.
TICKS_PER_BYTE = 1024


class BlockMeta(NamedTuple):
    """A block's identity: what its hash covers and where its chain puts it, the same in every
    tier (RAM block, write record, index row, file header) and never changed after creation.

    Whether a copy ends a saved sequence, holds a checkpoint, and how many payload bytes it
    has are not identity: a RAM block gains a checkpoint or a sequence end after it is made, and
    each tier keeps its own copy's state, so those stay beside ``meta`` in each record.
    A new key (an image digest, a quantization scheme) is a field here plus its storage name in
    ``META_COLUMNS``; the index schema and the file header follow that table.
    """

    block_hash: BlockHash
    parent_hash: BlockHash
    root: BlockHash  # the namespace root hash the chain starts from
    token_bytes: bytes
    extra: bytes = b""  # per-block extra keys (image digests, ...): compared wherever tokens are
    depth: int = 0  # tokens before this block

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // TOKEN_BYTES

    @property
    def end(self) -> int:
        return self.depth + len(self.token_bytes) // TOKEN_BYTES

    @property
    def first_token(self) -> int:
        return int.from_bytes(self.token_bytes[:TOKEN_BYTES], "little")


# BlockMeta field -> its name as an SQLite column and a block-file header key (the same names)
META_COLUMNS: dict[str, str] = {
    "block_hash": "hash",
    "parent_hash": "parent",
    "root": "root",
    "token_bytes": "tokens",
    "extra": "extra",
    "depth": "depth",
}
assert tuple(META_COLUMNS) == BlockMeta._fields

_EMPTY = BlockHash(b"")
# what a block without tokens carries (a what-if miniature's blocks): shared, so building one is cheap
NO_META = BlockMeta(_EMPTY, _EMPTY, _EMPTY, b"")


def root_meta(root: BlockHash) -> BlockMeta:
    """The metadata of a namespace root sentinel: no tokens, its own root."""
    return BlockMeta(root, _EMPTY, root, b"")


@dataclass(slots=True, eq=False)
class Block:
    """One resident block. Identity is the object; ``block_hash`` is the key in the tier index."""

    # == meta.block_hash, kept as a slot: policies and indexes read it on every insert and evict
    block_hash: BlockHash
    parent: Block | None  # None only for a namespace root sentinel
    meta: BlockMeta = NO_META
    payload: Any = None
    checkpoint: Any = None
    nbytes: int = 0  # payload + checkpoint bytes, as accounted by the tier
    ref_count: int = 0
    num_children: int = 0
    # children indexed by their first token id; partial blocks are always leaves
    children: dict[int, list[Block]] = field(default_factory=dict)
    is_seq_end: bool = False
    # stamped by the tier on every use: its clock (bytes inserted + uses) and lookup hits, so
    # policies read them lazily instead of walking every block of every request
    last_access: int = 0
    num_hits: int = 0
    # sessions (``sessions.session_key``) that used it; None until one does (most never do)
    sessions: set[str] | None = None
    ttl_s: float | None = None  # the longest TTL hint of a request that used it
    used_at: float = 0.0  # wall-clock (the cache's clock) of its last use, for expiry

    @property
    def token_bytes(self) -> bytes:
        return self.meta.token_bytes

    @property
    def extra(self) -> bytes:
        return self.meta.extra

    @property
    def depth(self) -> int:
        return self.meta.depth

    @property
    def root(self) -> BlockHash:
        return self.meta.root

    @property
    def num_tokens(self) -> int:
        return len(self.meta.token_bytes) // TOKEN_BYTES

    @property
    def end(self) -> int:
        m = self.meta
        return m.depth + len(m.token_bytes) // TOKEN_BYTES

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.num_children == 0 and self.parent is not None

    def first_token(self) -> int:
        return int.from_bytes(self.meta.token_bytes[:TOKEN_BYTES], "little")


class Node:
    """A policy's per-block entry: the block plus links for a ``NodeList``. Policies keep their
    own nodes (several policies can track one block at once), subclassing this for their data."""

    __slots__ = ("block", "prev", "next")

    def __init__(self, block: Block) -> None:
        self.block = block
        self.prev: Node | None = None
        self.next: Node | None = None


class NodeList:
    """Doubly linked list of ``Node``: O(1) append, insert, remove, pop.

    A node is in at most one NodeList at a time (the owner guarantees it).
    """

    __slots__ = ("head", "tail", "size")

    def __init__(self) -> None:
        self.head: Node | None = None
        self.tail: Node | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Node]:
        node = self.head
        while node is not None:
            nxt = node.next
            yield node
            node = nxt

    def append(self, node: Node) -> None:
        self.insert_before(None, node)

    def insert_before(self, anchor: Node | None, node: Node) -> None:
        """Insert ``node`` before ``anchor`` (at the tail when anchor is None)."""
        prev = self.tail if anchor is None else anchor.prev
        node.prev, node.next = prev, anchor
        if prev is None:
            self.head = node
        else:
            prev.next = node
        if anchor is None:
            self.tail = node
        else:
            anchor.prev = node
        self.size += 1

    def remove(self, node: Node) -> None:
        if node.prev is None:
            self.head = node.next
        else:
            node.prev.next = node.next
        if node.next is None:
            self.tail = node.prev
        else:
            node.next.prev = node.prev
        node.prev = node.next = None
        self.size -= 1

    def pop_head(self) -> Node | None:
        node = self.head
        if node is not None:
            self.remove(node)
        return node


def stamp_use(blocks: Iterable[Block], now: int, is_hit: bool) -> None:
    """Record a use on each block (what policies read lazily): the RAM tier and its what-if
    miniatures stamp alike, so a miniature at full size stays hit-for-hit the tier."""
    for blk in blocks:
        blk.last_access = now
        if is_hit:
            blk.num_hits += 1
