"""The lower-tier chain: any LowerTier behind RAM, promotion from the one reaching furthest,
reads outside the cache's lock with the RAM they need reserved."""

from __future__ import annotations

import threading

import numpy as np
from core_helpers import assert_restores, make_slicer

from promptcache.core.cache import PromptCache
from promptcache.core.chain import checkpoint_path, match_chain
from promptcache.core.tiers.base import BlockRecord, NullTier, StoredBlock
from promptcache.core.tiers.factory import build_tiers
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK = 4
BLOCK_BYTES = BLOCK * 2 * 8  # make_slicer: two int64 per token


class DictTier(NullTier):
    """An in-memory lower tier; ``gate`` (when set) holds every read until it opens."""

    write_through = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocks: dict[bytes, tuple[StoredBlock, object, object]] = {}
        self.gate: threading.Event | None = None
        self.reading = threading.Event()
        self.hits = self.misses = self.failures = 0

    # the BlockIndex the shared walk reads
    def get(self, block_hash):
        found = self.blocks.get(block_hash)
        return found[0] if found else None

    def children(self, parent, first_token):
        return [
            b
            for b, _, _ in self.blocks.values()
            if b.meta.parent_hash == parent and b.meta.first_token == first_token
        ]

    def put(self, record: BlockRecord) -> bool:
        stored = StoredBlock(
            record.meta, record.nbytes, record.checkpoint is not None, record.is_seq_end
        )
        self.blocks[record.meta.block_hash] = (stored, record.payload, record.checkpoint)
        return True

    def lookup(self, seq, start, parent, requires_checkpoint):
        full, tail, _ = match_chain(self, seq, start, parent)
        if requires_checkpoint:
            return checkpoint_path(self, seq, start, parent, full)
        return full if tail is None else [*full, tail]

    def read(self, blocks):
        self.reading.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        out = []
        for b in blocks:
            found = self.blocks.get(b.block_hash)
            out.append(KeyError(b.block_hash) if found is None else (found[1], found[2]))
        return out

    def touch(self, hashes):
        self.hits += 1

    def note_miss(self, failed):
        if failed:
            self.failures += 1
        else:
            self.misses += 1

    def used_bytes(self):
        return sum(b.nbytes for b, _, _ in self.blocks.values())


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def test_promotion_picks_the_tier_that_extends_furthest():
    near, far = DictTier("near"), DictTier("far")
    a = tokens(1, 40)
    # the far tier alone got the whole sequence; the near one only its first half
    donor = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[far])
    donor.save(donor.sequence(a), None, make_slicer(a))
    half = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[near])
    half.save(half.sequence(a[:20]), None, make_slicer(a))
    cache = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[near, far])
    with cache.lookup(cache.sequence(a + [7])) as hit:
        assert hit.num_tokens == 40
    assert (far.hits, near.hits, near.misses) == (1, 0, 1)
    st = cache.stats()
    assert set(st.bytes_by_tier) == {"ram", "near", "far"}
    cache.check_integrity()


def test_a_save_during_a_promotion_read_keeps_the_reservation():
    tier = DictTier("slow")
    a, b = tokens(2, 32), tokens(3, 32)
    donor = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=tier)
    donor.save(donor.sequence(a), None, make_slicer(a))
    budget = 12 * BLOCK_BYTES  # a's 8 blocks reserved leave room for 4 more
    cache = PromptCache("m", block_size=BLOCK, ram_budget=budget, next_tier=tier)
    tier.gate = threading.Event()
    result = {}

    def lookup():
        with cache.lookup(cache.sequence(a + [7])) as hit:
            result["hit"] = hit.num_tokens

    t = threading.Thread(target=lookup)
    t.start()
    try:
        assert tier.reading.wait(10)
        # the read runs outside the lock: a save goes on meanwhile, but only into what is left
        assert cache.ram.reserved_bytes == 8 * BLOCK_BYTES
        saved = cache.save(cache.sequence(b), None, make_slicer(b))
        assert saved.num_new_blocks == 4
        cache.check_integrity()  # used + reserved <= budget, exactly
    finally:
        tier.gate.set()
        t.join(10)
    assert result["hit"] == 32 and cache.ram.reserved_bytes == 0
    cache.check_integrity()


def test_concurrent_promotions_and_saves_keep_integrity():
    tier = DictTier("mem")
    seqs = [tokens(10 + i, 24 + 4 * (i % 3)) for i in range(6)]
    donor = PromptCache("m", block_size=BLOCK, ram_budget=10**7, next_tier=tier)
    for s in seqs:
        donor.save(donor.sequence(s), None, make_slicer(s))
    cache = PromptCache("m", block_size=BLOCK, ram_budget=16 * BLOCK_BYTES, next_tier=tier)
    errors: list[BaseException] = []
    hits = [0]

    def promoter():
        try:
            for i in range(150):
                s = seqs[i % len(seqs)]
                with cache.lookup(cache.sequence(s + [1])) as hit:
                    hits[0] += hit.num_tokens > 0
                cache.check_integrity()
        except BaseException as exc:
            errors.append(exc)

    def saver():
        try:
            for i in range(150):
                s = tokens(1000 + i, 20)
                cache.save(cache.sequence(s), None, make_slicer(s))
                cache.check_integrity()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=promoter), threading.Thread(target=saver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert hits[0] > 0 and tier.hits > 0
    assert cache.ram.reserved_bytes == 0
    assert all(b.ref_count == 0 for b in cache.ram.tree.index.values())
    cache.check_integrity()


def test_build_tiers_builds_the_ssd_tier(tmp_path):
    assert build_tiers(fingerprint="m") == []
    tiers = build_tiers(fingerprint="m" * 32, ssd_dir=tmp_path, ssd_budget="1MB")
    assert [t.name for t in tiers] == ["ssd"]
    cache = PromptCache("m" * 32, block_size=BLOCK, ram_budget=10**6, next_tier=tiers)
    a = tokens(5, 12)
    cache.save(cache.sequence(a), None, make_slicer(a))
    cache.check_integrity()
    assert cache.stats().tiers["ssd"]["budget_bytes"] == 10**6
    cache.close()


def test_concurrent_ssd_promotions_and_saves_keep_integrity(tmp_path):
    def open_cache(ram_blocks):
        tiers = build_tiers(fingerprint="f" * 32, ssd_dir=tmp_path, ssd_budget="100MB")
        return PromptCache(
            "f" * 32, block_size=BLOCK, ram_budget=ram_blocks * BLOCK_BYTES, next_tier=tiers
        )

    seqs = [tokens(20 + i, 24 + 4 * (i % 3)) for i in range(4)]
    cache = open_cache(10**4)
    for s in seqs:
        cache.save(cache.sequence(s), None, make_slicer(s))
    cache.close()
    cache = open_cache(16)  # a fresh RAM tier: every hit comes back from the files
    errors: list[BaseException] = []

    def run(body):
        try:
            for i in range(40):
                body(i)
                cache.check_integrity()
        except BaseException as exc:
            errors.append(exc)

    def promote(i):
        s = seqs[i % len(seqs)]
        with cache.lookup(cache.sequence(s + [1])) as hit:
            assert hit.num_tokens == 0 or hit.segments()[0][0] is not None

    def save(i):
        s = tokens(2000 + i, 16)
        cache.save(cache.sequence(s), None, make_slicer(s))

    threads = [threading.Thread(target=run, args=(f,)) for f in (promote, save)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert cache.stats().tiers["ssd"]["num_promoted_blocks"] > 0
    assert cache.ram.reserved_bytes == 0
    cache.check_integrity()
    cache.close()


def test_ram_makes_room_for_the_blocks_a_stalled_ssd_writer_still_holds(tmp_path):
    ssd = SsdTier(tmp_path, "m")
    budget = 16 * BLOCK_BYTES
    cache = PromptCache("m", block_size=BLOCK, ram_budget=budget, next_tier=ssd)
    seqs = [tokens(40 + i, 32) for i in range(6)]  # 8 blocks each
    gate, write = threading.Event(), ssd.writer._write
    ssd.writer._write = lambda record: (gate.wait(60), write(record))  # the writer stalls
    try:
        for s in seqs:
            cache.save(cache.sequence(s), None, make_slicer(s))
            queued = cache.tiers.queued_bytes()
            assert queued == ssd.queued_bytes() <= budget
            # RAM and the queued blocks fit the budget together, the save's own write-through
            # included (it queued after RAM made room)
            assert cache.ram.held_bytes + queued <= budget
            cache.ram.check_integrity()  # the whole check would wait for the SSD's writes
        assert ssd.describe()["dropped_writes"] > 0
    finally:
        gate.set()
    assert ssd.flush(10) and cache.tiers.queued_bytes() == 0
    cache.check_integrity()
    for s in seqs:  # RAM or SSD serves what each kept, exactly
        with cache.lookup(cache.sequence(s + [7])) as hit:
            assert_restores(hit, s)
    # nothing queued: RAM has its whole budget again
    big = tokens(99, 16 * BLOCK)
    assert cache.save(cache.sequence(big), None, make_slicer(big)).num_new_blocks == 16
    cache.check_integrity()
