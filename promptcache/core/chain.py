"""The one prefix walk, over any index of blocks (the RAM prefix tree, the SSD's SQLite index).

A request's blocks are found by their chained hashes and each one is verified: its parent hash,
its token bytes and its extra keys (image digests, ...) must be the request's, so a hash
collision can never serve another prompt's state. Past the whole blocks, the child sharing the
longest prefix with what follows extends the match token by token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from promptcache.core.block import BlockMeta
from promptcache.core.hashing import TOKEN_BYTES, TOKEN_DTYPE, BlockHash
from promptcache.core.sequence import TokenSeq, extras_agree_upto


class ChainEntry(Protocol):
    """What an index holds per block: its metadata and whether this copy has a checkpoint."""

    @property
    def meta(self) -> BlockMeta: ...

    @property
    def has_checkpoint(self) -> bool: ...


_PARENT, _TOKENS, _EXTRA = (
    BlockMeta._fields.index(f) for f in ("parent_hash", "token_bytes", "extra")
)

E = TypeVar("E", bound=ChainEntry)
E_co = TypeVar("E_co", bound=ChainEntry, covariant=True)


class BlockIndex(Protocol[E_co]):
    """Blocks by hash and by (parent hash, first token id).

    Contract: ``get(h)`` is the entry whose ``meta.block_hash == h``, or None; ``children(p, t)``
    holds every entry whose ``meta.parent_hash == p`` and ``meta.first_token == t``, in an order
    that only changes when the index does (ties go to the first). Neither verifies tokens: the
    walk does.
    """

    def get(self, block_hash: BlockHash, /) -> E_co | None: ...

    def children(self, parent: BlockHash, first_token: int, /) -> Iterable[E_co]: ...


class ChainMatch(NamedTuple, Generic[E]):
    full: list[E]  # whole blocks of the request, verified, from the walk's start
    tail: E | None  # the child after them sharing the longest prefix with what follows
    tail_len: int  # tokens the tail shares with the request (0 without a tail)


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Number of leading token ids two token byte strings share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    x = np.frombuffer(a, dtype=TOKEN_DTYPE, count=n)
    y = np.frombuffer(b, dtype=TOKEN_DTYPE, count=n)
    return int(np.argmin(x == y))


def walk_full(
    index: BlockIndex[E], seq: TokenSeq, start: int, parent: BlockHash, stop: int
) -> list[E]:
    """Indexed whole blocks ``start .. stop - 1`` of ``seq`` after ``parent`` (the hash of block
    ``start - 1``, or the root), each verified; stops at the first missing or different one."""
    out: list[E] = []
    if start >= stop:
        return out
    hashes = seq.hashes_upto(stop)
    get = index.get
    data, step = seq.data, seq.block_size * TOKEN_BYTES
    extra = seq.extra if seq.has_extras else None
    off = start * step
    # the hot loop of every lookup and save: iterate the hashes, not indices into them
    for h in hashes if start == 0 and stop == len(hashes) else hashes[start:stop]:
        entry = get(h)
        if entry is None:
            break
        # by index: tuple indexing is specialised by the interpreter, named fields are not
        m = entry.meta
        if (
            m[_PARENT] != parent
            or m[_TOKENS] != data[off : off + step]
            or (m[_EXTRA] if extra is None else m[_EXTRA] != extra(off // step))
        ):
            break
        out.append(entry)
        parent = h  # == m.block_hash: get() returns only the entry filed under h
        off += step
    return out


def best_child(
    index: BlockIndex[E], seq: TokenSeq, block: int, parent: BlockHash
) -> tuple[E | None, int]:
    """(child of ``parent`` sharing the longest prefix with ``seq`` from block ``block`` on,
    tokens shared): tokens and extra keys must agree (a child whose keys differ shares only the
    tokens before the first differing key: another image from its first token on); on a tie one
    with a checkpoint wins, then the first. (None, 0) when no child shares a token."""
    b, n = seq.block_size, seq.num_tokens
    pos = block * b
    want = seq.block_bytes(pos, min(pos + b, n))
    extra = seq.extra(block)
    best: E | None = None
    best_len, best_ckpt = 0, False
    for child in index.children(parent, seq.token(pos)):
        m = child.meta
        common = common_prefix_tokens(m.token_bytes, want)
        if m.extra != extra:
            common = extras_agree_upto(m.extra, extra, common)
        if common > best_len or (common == best_len and not best_ckpt and child.has_checkpoint):
            best, best_len, best_ckpt = child, common, child.has_checkpoint
    return (best, best_len) if best_len else (None, 0)


def match_chain(
    index: BlockIndex[E], seq: TokenSeq, start: int = 0, parent: BlockHash | None = None
) -> ChainMatch[E]:
    """The longest indexed continuation of ``seq`` after full block ``start - 1`` (hash
    ``parent``; the namespace root when ``start`` is 0): whole blocks, then the best child."""
    if parent is None:
        parent = seq.root
    full = walk_full(index, seq, start, parent, seq.num_full_blocks)
    block = start + len(full)
    if block * seq.block_size >= seq.num_tokens:
        return ChainMatch(full, None, 0)
    tail, tail_len = best_child(index, seq, block, full[-1].meta.block_hash if full else parent)
    return ChainMatch(full, tail, tail_len)


def checkpoint_path(
    index: BlockIndex[E], seq: TokenSeq, start: int, parent: BlockHash, full: list[E]
) -> list[E]:
    """For a model with snapshot layers, where a hit can only end on a checkpoint: the deepest
    prefix of ``full`` (whole blocks from ``start``, as ``walk_full`` found them) plus one block
    ending on a checkpoint at <= n - 1 tokens, a whole block's or a shorter sibling's (a saved
    sequence's end). Levels are tried from the deepest up; [] when none has one."""
    n, b = seq.num_tokens, seq.block_size
    for level in range(len(full), -1, -1):
        depth = (start + level) * b
        if depth >= n - 1:
            continue
        at = full[level - 1].meta.block_hash if level else parent
        want = seq.block_bytes(depth, min(depth + b, n - 1))
        extra = seq.extra(start + level)
        best: E | None = None
        for child in index.children(at, seq.token(depth)):
            m = child.meta
            if (
                child.has_checkpoint
                and m.extra == extra
                and (best is None or len(m.token_bytes) > len(best.meta.token_bytes))
                and want.startswith(m.token_bytes)  # whole tokens: both start at ``depth``
            ):
                best = child
        if best is not None:
            return [*full[:level], best]
    return []


def chain_reach(seq: TokenSeq, chain: list[E]) -> int:
    """Tokens of ``seq`` a continuation found by the walk covers (its last block may be used
    partially); 0 for an empty chain."""
    if not chain:
        return 0
    last = chain[-1].meta
    want = seq.block_bytes(last.depth, min(last.depth + seq.block_size, seq.num_tokens))
    common = common_prefix_tokens(last.token_bytes, want)
    extra = seq.extra(last.depth // seq.block_size)
    return last.depth + (
        common if last.extra == extra else extras_agree_upto(last.extra, extra, common)
    )


def find_partial(
    index: BlockIndex[E], seq: TokenSeq, parent: BlockHash, start: int, end: int, longer: bool
) -> E | None:
    """A child of ``parent`` holding exactly ``seq[start:end]`` (a partial block, same extra
    keys), or with ``longer`` one whose tokens start with them; the exact one first."""
    want = seq.block_bytes(start, end)
    extra = seq.extra(start // seq.block_size)
    covering: E | None = None
    for child in index.children(parent, seq.token(start)):
        m = child.meta
        if m.extra != extra:
            continue
        if m.token_bytes == want:
            return child
        if longer and covering is None and m.token_bytes.startswith(want):
            covering = child
    return covering
