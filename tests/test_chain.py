"""The shared prefix walk (core/chain.py) on a plain in-memory index."""

from __future__ import annotations

from typing import NamedTuple

from promptcache.core.block import BlockMeta
from promptcache.core.chain import (
    chain_reach,
    checkpoint_path,
    find_partial,
    match_chain,
    walk_full,
)
from promptcache.core.hashing import BlockHash, Namespace
from promptcache.core.sequence import TokenSeq

ROOT = Namespace("m").root_hash()
B = 4


class Entry(NamedTuple):
    meta: BlockMeta
    has_checkpoint: bool = False


class DictIndex:
    def __init__(self, entries: list[Entry]) -> None:
        self.by_hash = {e.meta.block_hash: e for e in entries}

    def get(self, block_hash: BlockHash) -> Entry | None:
        return self.by_hash.get(block_hash)

    def children(self, parent: BlockHash, first_token: int) -> list[Entry]:
        return [
            e
            for e in self.by_hash.values()
            if e.meta.parent_hash == parent and e.meta.first_token == first_token
        ]


def seq_of(tokens, extras=None) -> TokenSeq:
    return TokenSeq(ROOT, tokens, B, extras)


def full_entries(seq: TokenSeq, checkpoints=()) -> list[Entry]:
    return [Entry(seq.block_meta(i), i in checkpoints) for i in range(seq.num_full_blocks)]


def test_walk_verifies_extra_keys_not_only_the_hash():
    seq = seq_of(list(range(12)))
    entries = full_entries(seq)
    # a forged entry under block 1's hash with other extra keys (a collision) ends the walk
    entries[1] = Entry(entries[1].meta._replace(extra=b"image"))
    assert len(walk_full(DictIndex(entries), seq, 0, ROOT, 3)) == 1


def test_walk_verifies_parent_and_tokens():
    seq = seq_of(list(range(12)))
    entries = full_entries(seq)
    entries[2] = Entry(entries[2].meta._replace(token_bytes=seq.block_bytes(0, 4)))
    assert len(walk_full(DictIndex(entries), seq, 0, ROOT, 3)) == 2
    entries = full_entries(seq)
    entries[1] = Entry(entries[1].meta._replace(parent_hash=ROOT))
    assert len(walk_full(DictIndex(entries), seq, 0, ROOT, 3)) == 1


def test_match_prefers_a_checkpoint_on_ties_and_the_longest_prefix():
    saved = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    a = Entry(saved.partial_meta(6))  # [5, 6]
    b = Entry(saved.prefix(7).partial_meta(7), has_checkpoint=True)  # [5, 6, 7]
    index = DictIndex([Entry(saved.block_meta(0)), a, b])
    full, tail, tail_len = match_chain(index, seq_of([1, 2, 3, 4, 5, 6, 99]))
    assert len(full) == 1 and tail == b and tail_len == 2  # tie at 2 tokens: the checkpoint
    full, tail, tail_len = match_chain(index, seq_of([1, 2, 3, 4, 5, 6, 7, 0]))
    assert tail == b and tail_len == 3
    assert chain_reach(seq_of([1, 2, 3, 4, 5, 6, 7, 0]), [*full, tail]) == 7


def test_checkpoint_path_takes_the_deepest_checkpoint_below_the_last_token():
    saved = seq_of(list(range(1, 13)))
    short = Entry(saved.prefix(6).partial_meta(6), has_checkpoint=True)  # ends at 6
    entries = [*full_entries(saved, checkpoints={0}), short]
    index = DictIndex(entries)
    seq = seq_of(list(range(1, 13)) + [50])
    full = walk_full(index, seq, 0, ROOT, seq.num_full_blocks)
    assert len(full) == 3
    path = checkpoint_path(index, seq, 0, ROOT, full)
    assert path == [entries[0], short]  # blocks 1 and 2 have none: the sibling at 6 wins
    assert checkpoint_path(index, seq_of([1, 2, 3, 4, 5]), 0, ROOT, full[:1]) == [entries[0]]
    assert checkpoint_path(index, seq_of([1, 2, 3, 4]), 0, ROOT, full[:1]) == []


def test_find_partial_exact_first_then_covering_with_equal_extras():
    saved = seq_of([1, 2, 3, 4, 5, 6, 7, 8])
    longer = Entry(saved.block_meta(1))
    index = DictIndex([Entry(saved.block_meta(0)), longer])
    parent = saved.block_hash(0)
    seq = seq_of([1, 2, 3, 4, 5, 6])
    assert find_partial(index, seq, parent, 4, 6, longer=True) == longer
    assert find_partial(index, seq, parent, 4, 6, longer=False) is None
    exact = Entry(seq.partial_meta(6))
    index = DictIndex([Entry(saved.block_meta(0)), longer, exact])
    assert find_partial(index, seq, parent, 4, 6, longer=True) == exact
    other = seq_of([1, 2, 3, 4, 5, 6], extras={5: b"img"})
    assert find_partial(index, other, parent, 4, 6, longer=True) is None
