"""A request's token ids, with their block hashes computed lazily and at most once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from promptcache.core.block import BlockMeta
from promptcache.core.hashing import TOKEN_BYTES, BlockHash, hash_block, tokens_to_bytes
from promptcache.core.sessions import NO_USE, BlockUse


def extra_entry(offset: int, key: bytes) -> bytes:
    """One extra key as a block stores it: offset in the block, key length, key."""
    return offset.to_bytes(4, "little") + len(key).to_bytes(4, "little") + key


def _entries(extra: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i + 8 <= len(extra):
        offset = int.from_bytes(extra[i : i + 4], "little")
        size = int.from_bytes(extra[i + 4 : i + 8], "little")
        out.append((offset, extra[i + 8 : i + 8 + size]))
        i += 8 + size
    return out


def extras_agree_upto(a: bytes, b: bytes, limit: int) -> int:
    """How many leading tokens (at most ``limit``) two blocks' extra keys allow to share: up
    to the offset of the first entry in which they differ."""
    if a == b:
        return limit
    x, y = _entries(a), _entries(b)
    for i in range(max(len(x), len(y))):
        ex = x[i] if i < len(x) else None
        ey = y[i] if i < len(y) else None
        if ex != ey:
            first = min(e[0] for e in (ex, ey) if e is not None)
            return min(limit, first)
    return 0  # equal entries but unequal bytes: a malformed key, share nothing


class TokenSeq:
    """Token ids under one namespace root, split into ``block_size`` blocks.

    ``extras`` maps a token position to extra key bytes (an image digest at its placeholder):
    the block containing that position hashes them too, as entries (offset in the block, key)
    in position order, so a partial match can stop where two blocks' keys start to differ. Hashes are computed on demand and cached,
    so a lookup followed by several saves of the same request hashes each block once.
    """

    __slots__ = ("root", "block_size", "data", "num_tokens", "use", "_extras", "_hashes")

    def __init__(
        self,
        root: BlockHash,
        tokens: Sequence[int] | np.ndarray | bytes,
        block_size: int,
        extras: Mapping[int, bytes] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.root = root
        self.block_size = block_size
        self.data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
        if len(self.data) % TOKEN_BYTES:
            raise ValueError("token bytes must be a whole number of uint32 ids")
        self.num_tokens = len(self.data) // TOKEN_BYTES
        # the request's session tag and TTL hint: recorded on the blocks it touches, never hashed
        self.use: BlockUse = NO_USE
        self._extras: dict[int, bytes] = {}
        for pos, key in sorted((extras or {}).items()):
            if not 0 <= pos < self.num_tokens:
                raise ValueError(f"extra key position {pos} outside the sequence")
            block = pos // block_size
            self._extras[block] = self._extras.get(block, b"") + extra_entry(pos % block_size, key)
        self._hashes: list[BlockHash] = []

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def block_bytes(self, start: int, end: int) -> bytes:
        """Token bytes of positions [start, end)."""
        return self.data[start * TOKEN_BYTES : end * TOKEN_BYTES]

    def extra(self, block_index: int) -> bytes:
        return self._extras.get(block_index, b"")

    def same_extras(self, other: TokenSeq, num_tokens: int) -> bool:
        """Whether both sequences have the same extra keys in the blocks holding their first
        ``num_tokens`` tokens (same block size assumed)."""
        stop = -(-num_tokens // self.block_size)
        mine = {k: v for k, v in self._extras.items() if k < stop}
        return mine == {k: v for k, v in other._extras.items() if k < stop}

    def token(self, pos: int) -> int:
        return int.from_bytes(self.data[pos * TOKEN_BYTES : (pos + 1) * TOKEN_BYTES], "little")

    def tokens(self) -> list[int]:
        return np.frombuffer(self.data, dtype="<u4").tolist()

    def block_hash(self, index: int) -> BlockHash:
        """Hash of full block ``index`` (0-based); computes and caches all hashes up to it."""
        hashes = self._hashes
        if index < len(hashes):
            return hashes[index]
        if index >= self.num_full_blocks:
            raise IndexError(f"block {index} is not full")
        step = self.block_size * TOKEN_BYTES
        data, extras = self.data, self._extras
        parent = hashes[-1] if hashes else self.root
        for i in range(len(hashes), index + 1):
            parent = hash_block(parent, data[i * step : (i + 1) * step], extras.get(i, b""))
            hashes.append(parent)
        return parent

    def hashes_upto(self, stop: int) -> list[BlockHash]:
        """The computed hashes, at least of full blocks ``0 .. stop - 1`` (shared, do not
        mutate; may be longer)."""
        if stop > len(self._hashes):
            self.block_hash(stop - 1)
        return self._hashes

    def full_hashes(self) -> list[BlockHash]:
        """Hashes of every full block (computed once; the list is shared, do not mutate)."""
        if self.num_full_blocks:
            self.block_hash(self.num_full_blocks - 1)
        return self._hashes

    @property
    def has_extras(self) -> bool:
        return bool(self._extras)

    def parent_hash(self, index: int) -> BlockHash:
        return self.root if index == 0 else self.block_hash(index - 1)

    def partial_hash(self, end: int) -> BlockHash:
        """Hash of the partial block that ends at ``end`` (not a block boundary)."""
        i = end // self.block_size
        return hash_block(
            self.parent_hash(i), self.block_bytes(i * self.block_size, end), self.extra(i)
        )

    def block_meta(self, index: int) -> BlockMeta:
        """Metadata of full block ``index``."""
        b = self.block_size
        hashes = self.hashes_upto(index + 1)
        return BlockMeta(
            hashes[index],
            hashes[index - 1] if index else self.root,
            self.root,
            self.block_bytes(index * b, (index + 1) * b),
            self._extras.get(index, b""),
            index * b,
        )

    def partial_meta(self, end: int) -> BlockMeta:
        """Metadata of the partial block that ends at ``end`` (not a block boundary)."""
        i, b = end // self.block_size, self.block_size
        return BlockMeta(
            self.partial_hash(end),
            self.parent_hash(i),
            self.root,
            self.block_bytes(i * b, end),
            self._extras.get(i, b""),
            i * b,
        )

    def extend(self, tokens: Sequence[int] | np.ndarray) -> TokenSeq:
        """This sequence followed by ``tokens``, keeping the hashes already computed."""
        out = TokenSeq.__new__(TokenSeq)
        out.root, out.block_size = self.root, self.block_size
        out.data = self.data + tokens_to_bytes(tokens)
        out.num_tokens = len(out.data) // TOKEN_BYTES
        out.use = self.use
        out._extras = dict(self._extras)
        out._hashes = list(self._hashes)
        return out

    def prefix(self, num_tokens: int) -> TokenSeq:
        """The first ``num_tokens`` tokens, sharing computed hashes."""
        out = TokenSeq.__new__(TokenSeq)
        out.root, out.block_size = self.root, self.block_size
        out.data = self.data[: num_tokens * TOKEN_BYTES]
        out.num_tokens = num_tokens
        out.use = self.use
        out._extras = {k: v for k, v in self._extras.items() if k * self.block_size < num_tokens}
        out._hashes = self._hashes[: num_tokens // self.block_size]
        return out
