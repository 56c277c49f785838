"""Prefix tree of resident blocks: hash index plus token-exact matching.

Whole blocks are found by walking the hash chain and verified against their stored token ids
(so a hash collision can never serve wrong state); inside the first block that differs, the
longest common prefix with a resident child's tokens extends the match token by token.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from promptcache.core.block import Block, root_meta
from promptcache.core.hashing import TOKEN_BYTES, BlockHash
from promptcache.core.sequence import TokenSeq

HIT_KINDS = ("exact", "prefix", "mid_block", "supersequence")


class Match(NamedTuple):
    num_tokens: int  # usable hit: state for [0, num_tokens) can be restored
    blocks: tuple[Block, ...]  # covering [0, num_tokens); the last may be used partially
    kind: str  # one of HIT_KINDS, or "miss"
    num_matched: int  # raw common prefix with the tree, before the last-token and checkpoint caps


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Number of leading token ids two uint32 byte strings share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    x = np.frombuffer(a, dtype="<u4", count=n)
    y = np.frombuffer(b, dtype="<u4", count=n)
    return int(np.argmin(x == y))


class PrefixTree:
    """Resident blocks by hash, with one root sentinel per namespace. Not thread-safe."""

    __slots__ = ("index", "roots")

    def __init__(self) -> None:
        self.index: dict[BlockHash, Block] = {}
        self.roots: dict[BlockHash, Block] = {}

    def __len__(self) -> int:
        return len(self.index)

    def root(self, root_hash: BlockHash, create: bool = False) -> Block | None:
        node = self.roots.get(root_hash)
        if node is None and create:
            node = self.roots[root_hash] = Block(root_hash, None, root_meta(root_hash))
        return node

    def add(self, block: Block) -> None:
        """Make ``block`` resident under ``block.parent`` (which must be resident or a root)."""
        parent = block.parent
        assert parent is not None and block.block_hash not in self.index
        self.index[block.block_hash] = block
        parent.children.setdefault(block.first_token(), []).append(block)
        parent.num_children += 1

    def remove(self, block: Block) -> None:
        """Drop a leaf; an unpinned root left without children is dropped too."""
        assert block.num_children == 0, "only leaves leave the tree"
        parent = block.parent
        assert parent is not None
        del self.index[block.block_hash]
        first = block.first_token()
        siblings = parent.children[first]
        siblings.remove(block)
        if not siblings:
            del parent.children[first]
        parent.num_children -= 1
        if parent.parent is None and parent.num_children == 0 and parent.ref_count == 0:
            self.roots.pop(parent.block_hash, None)

    def full_path(self, seq: TokenSeq, num_blocks: int) -> list[Block]:
        """Resident full blocks of ``seq[: num_blocks * block_size]`` from its root, each verified
        against its parent object and stored tokens; stops at the first that is missing."""
        node = self.roots.get(seq.root)
        b = seq.block_size
        path: list[Block] = []
        for i in range(num_blocks if node is not None else 0):
            blk = self.index.get(seq.block_hash(i))
            if (
                blk is None
                or blk.parent is not node
                or blk.token_bytes != seq.block_bytes(i * b, (i + 1) * b)
            ):
                break
            path.append(blk)
            node = blk
        return path

    def match(self, seq: TokenSeq, requires_checkpoint: bool = False) -> Match:
        """Longest usable cached prefix of ``seq``; leaves at least the last token to compute.

        With ``requires_checkpoint`` (a model with snapshot layers) the hit must end where a
        checkpoint was saved: a block boundary or the exact end of a saved sequence.
        """
        n = seq.num_tokens
        node = self.roots.get(seq.root)
        if node is None or n == 0:
            return Match(0, (), "miss", 0)
        b = seq.block_size
        path: list[Block] = []
        pos = 0
        index_get, data, step = self.index.get, seq.data, b * TOKEN_BYTES
        has_extras = seq.has_extras
        off = 0
        for h in seq.full_hashes():
            blk = index_get(h)
            if (
                blk is None
                or blk.parent is not node
                or blk.token_bytes != data[off : off + step]
                or blk.extra != (seq.extra(off // step) if has_extras else b"")
            ):
                break
            path.append(blk)
            node = blk
            off += step
        pos = len(path) * b
        tail: Block | None = None
        tail_len = 0
        if pos < n:
            want = seq.block_bytes(pos, min(pos + b, n))
            extra = seq.extra(pos // b)
            for child in node.children.get(seq.token(pos), ()):
                if child.extra != extra:
                    continue
                common = common_prefix_tokens(child.token_bytes, want)
                if common > tail_len:
                    tail, tail_len = child, common
        matched = pos + tail_len
        if tail is not None:
            path.append(tail)
        kind = _classify(path, matched, n, tail, tail_len)

        if requires_checkpoint:
            full = path[:-1] if tail is not None else path
            return self._match_checkpoint(seq, full, kind, matched)

        hit = min(matched, n - 1)
        if hit == 0:
            return Match(0, (), "miss", matched)
        used = len(path)
        while used and path[used - 1].depth >= hit:
            used -= 1
        return Match(hit, tuple(path[:used]), kind, matched)

    def _match_checkpoint(self, seq: TokenSeq, full: list[Block], kind: str, matched: int) -> Match:
        """Deepest checkpoint on the matched path: a full block's, or a partial sibling's that
        ends at a saved sequence's end. Scans levels from the deepest up; stops at the first hit."""
        n, b = seq.num_tokens, seq.block_size
        root = self.roots[seq.root]
        for level in range(len(full), -1, -1):
            depth = level * b
            if depth >= n - 1:
                continue
            node = full[level - 1] if level else root
            want = seq.block_bytes(depth, min(depth + b, n - 1))
            extra = seq.extra(level)
            best: Block | None = None
            for child in node.children.get(seq.token(depth), ()):
                if (
                    child.checkpoint is not None
                    and child.end <= n - 1
                    and child.extra == extra
                    and (best is None or child.num_tokens > best.num_tokens)
                    and want.startswith(child.token_bytes)
                ):
                    best = child
            if best is not None:
                return Match(best.end, (*full[:level], best), kind, matched)
        return Match(0, (), "miss", matched)


def _classify(path: list[Block], matched: int, n: int, tail: Block | None, tail_len: int) -> str:
    if matched == 0:
        return "miss"
    if matched >= n:
        last = path[-1]
        return "exact" if last.end == n and last.is_seq_end else "supersequence"
    if tail is not None and tail_len < tail.num_tokens:
        return "mid_block"
    return "prefix"
