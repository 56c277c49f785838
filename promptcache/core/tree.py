"""Prefix tree of resident blocks: hash index, children by first token, token-exact matching.

The tree is a ``chain.BlockIndex``: matching is the shared walk (``chain.match_chain``), here
turned into a usable hit (the last token left to compute, a checkpoint where one is needed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from promptcache.core.block import Block, root_meta
from promptcache.core.chain import best_child, checkpoint_path, walk_full
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq

HIT_KINDS = ("exact", "prefix", "mid_block", "supersequence")


class Match(NamedTuple):
    num_tokens: int  # usable hit: state for [0, num_tokens) can be restored
    blocks: tuple[Block, ...]  # covering [0, num_tokens); the last may be used partially
    kind: str  # one of HIT_KINDS, or "miss"
    num_matched: int  # raw common prefix with the tree, before the last-token and checkpoint caps


_NONE: list[Block] = []  # no children (shared, never mutated)


class PrefixTree:
    """Resident blocks by hash, with one root sentinel per namespace. Not thread-safe."""

    __slots__ = ("index", "roots", "get")

    def __init__(self) -> None:
        self.index: dict[BlockHash, Block] = {}
        self.roots: dict[BlockHash, Block] = {}
        # BlockIndex.get as the dict's own method: the walk calls it once per block
        self.get: Callable[[BlockHash], Block | None] = self.index.get

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

    def children(self, parent: BlockHash, first_token: int, /) -> list[Block]:
        node = self.index.get(parent) or self.roots.get(parent)
        return node.children.get(first_token, _NONE) if node is not None else _NONE

    def full_path(self, seq: TokenSeq, num_blocks: int) -> list[Block]:
        """Resident full blocks of ``seq[: num_blocks * block_size]`` from its root, each verified;
        stops at the first that is missing."""
        if seq.root not in self.roots:
            return []
        return walk_full(self, seq, 0, seq.root, num_blocks)

    def match(self, seq: TokenSeq, requires_checkpoint: bool = False) -> Match:
        """Longest usable cached prefix of ``seq``; leaves at least the last token to compute.

        With ``requires_checkpoint`` (a model with snapshot layers) the hit must end where a
        checkpoint was saved: a block boundary or the exact end of a saved sequence.
        """
        n = seq.num_tokens
        if n == 0 or seq.root not in self.roots:
            return Match(0, (), "miss", 0)
        # match_chain's two steps, inlined: this is the hot path of every lookup
        full = walk_full(self, seq, 0, seq.root, seq.num_full_blocks)
        tail, tail_len = None, 0
        if len(full) * seq.block_size < n:
            tail, tail_len = best_child(
                self, seq, len(full), full[-1].block_hash if full else seq.root
            )
        matched = len(full) * seq.block_size + tail_len
        path = full if tail is None else [*full, tail]
        kind = _classify(path, matched, n, tail, tail_len)

        if requires_checkpoint:
            hit_path = checkpoint_path(self, seq, 0, seq.root, full)
            if not hit_path:
                return Match(0, (), "miss", matched)
            return Match(hit_path[-1].end, tuple(hit_path), kind, matched)

        hit = min(matched, n - 1)
        if hit == 0:
            return Match(0, (), "miss", matched)
        used = len(path)
        while used and path[used - 1].depth >= hit:
            used -= 1
        return Match(hit, tuple(path[:used]), kind, matched)


def _classify(path: list[Block], matched: int, n: int, tail: Block | None, tail_len: int) -> str:
    if matched == 0:
        return "miss"
    if matched >= n:
        last = path[-1]
        return "exact" if last.end == n and last.is_seq_end else "supersequence"
    if tail is not None and tail_len < tail.num_tokens:
        return "mid_block"
    return "prefix"
