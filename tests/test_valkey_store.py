"""The shared (Valkey) tier against real valkey-server processes: no mocks."""

from __future__ import annotations

import time

import numpy as np
import pytest
from valkey_helpers import ValkeyCluster, ValkeyProcess, records, server_binary

from promptcache.core.block_file import CorruptBlockError
from promptcache.core.hashing import Namespace
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.shared.check import hottest_prefixes
from promptcache.core.tiers.shared.store import (
    SharedBlockMissingError,
    SharedBlockRaceError,
    ValkeyStore,
)

pytestmark = [
    pytest.mark.valkey,
    pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary"),
]

MODEL = "f" * 32
B = 8


@pytest.fixture
def server(tmp_path):
    proc = ValkeyProcess(tmp_path / "valkey").start()
    yield proc
    proc.stop()


def seq_of(tokens, tenant="", model=MODEL):
    return TokenSeq(Namespace(model, tenant).root_hash(), tokens, B)


def store_all(store, seq, **kw):
    recs = records(seq, **kw)
    for r in recs:
        assert store.put(r)
    assert store.flush(10)
    return recs


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def same(a, b):
    ka = [x for layer in a["layers"] for x in layer]
    kb = [x for layer in b["layers"] for x in layer]
    return a["index"] == b["index"] and all(
        np.array_equal(x, y) for x, y in zip(ka, kb, strict=True)
    )


@pytest.mark.parametrize("mode", ["lua", "pipeline"])
def test_round_trip_and_partial_tail(server, mode):
    writer = ValkeyStore(server.url, MODEL)
    reader = ValkeyStore(server.url, MODEL, lookup_mode=mode)  # another server, same Valkey
    try:
        tokens = list(range(100, 100 + 5 * B))
        seq = seq_of(tokens)
        recs = store_all(writer, seq, checkpoint_at={2})
        got = reader.lookup(seq, 0, seq.root)
        assert [m.block_hash for m in got] == [r.block_hash for r in recs]
        out = reader.read(got)
        for r, (payload, ckpt) in zip(recs, out, strict=True):
            assert same(payload, r.payload)
            assert (ckpt is None) == (r.checkpoint is None)
        assert np.array_equal(out[2][1]["state"], recs[2].checkpoint["state"])
        # from block 2 on, with parent = hash of block 1
        got = reader.lookup(seq, 2, seq.block_hash(1))
        assert [m.meta.depth // B for m in got] == [2, 3, 4]
        # a prompt that diverges mid-block 3: blocks 0-2 whole, then block 3 as the best child
        other = seq_of(tokens[: 3 * B + 5] + [7] * (B - 5) + [1] * B)
        got = reader.lookup(other, 0, other.root)
        assert [m.meta.depth // B for m in got] == [0, 1, 2, 3]
        assert got[3].block_hash == recs[3].block_hash
        # only a child that ends in a checkpoint and is covered whole may end a snapshot hit
        assert reader.lookup(other, 0, other.root, requires_checkpoint=True)[3:] == []
        ck = seq_of(tokens[: 2 * B + 3])
        assert [m.meta.depth // B for m in reader.lookup(ck, 0, ck.root)] == [0, 1, 2]
        assert reader.lookup(ck, 0, ck.root, requires_checkpoint=True)[2:] == []
        assert reader.lookup(seq_of([1, 2, 3] * B), 0, seq_of([1]).root) == []
        d = reader.describe()
        assert (
            d["state"] == "connected" and d["num_found"] >= 3 and d["num_lookups"] > d["num_found"]
        )
        assert sum(d["rtt_histogram"].values()) > 0
        writer.check_integrity()
    finally:
        writer.close()
        reader.close()


def test_tenants_and_models_apart(server):
    store = ValkeyStore(server.url, MODEL)
    try:
        tokens = list(range(3 * B))
        store_all(store, seq_of(tokens, "alice"))
        assert len(store.lookup(seq_of(tokens, "alice"), 0, seq_of(tokens, "alice").root)) == 3
        bob = seq_of(tokens, "bob")
        assert store.lookup(bob, 0, bob.root) == []
        other_model = seq_of(tokens, "alice", model="e" * 32)
        assert store.lookup(other_model, 0, other_model.root) == []
        store2 = ValkeyStore(server.url, "e" * 32)
        try:
            assert store2.lookup(other_model, 0, other_model.root) == []
        finally:
            store2.close()
    finally:
        store.close()


def test_corrupt_value_detected_deleted_never_served(server):
    store = ValkeyStore(server.url, MODEL)
    try:
        seq = seq_of(list(range(3 * B)))
        store_all(store, seq)
        raw = server.client()
        key = store.keys.data(seq.block_hash(1))
        value = bytearray(raw.get(key))
        value[-3] ^= 0xFF  # a flipped tensor byte: the checksum fails
        raw.set(key, bytes(value))
        metas = store.lookup(seq, 0, seq.root)
        out = store.read(metas)
        assert not isinstance(out[0], Exception) and not isinstance(out[2], Exception)
        assert isinstance(out[1], CorruptBlockError)
        assert not isinstance(out[1], SharedBlockMissingError)
        assert store.describe()["num_corrupt"] == 1
        assert raw.get(key) is None
        # the chain now ends before the bad block
        assert [m.meta.depth // B for m in store.lookup(seq, 0, seq.root)] == [0]
        # a value swapped for another valid block's bytes is caught too (identity)
        k0, k2 = store.keys.data(seq.block_hash(0)), store.keys.data(seq.block_hash(2))
        raw.set(k0, raw.get(k2))
        out = store.read(store.lookup(seq, 0, seq.root))
        assert isinstance(out[0], CorruptBlockError)
        store.check_integrity()
    finally:
        store.close()


def test_server_killed_then_restarted_empty(server):
    store = ValkeyStore(server.url, MODEL, timeout_s=0.3, retry_s=0.05)
    try:
        seq = seq_of(list(range(4 * B)))
        store_all(store, seq)
        assert len(store.lookup(seq, 0, seq.root)) == 4
        metas = store.lookup(seq, 0, seq.root)
        server.stop(kill=True)
        t0 = time.monotonic()
        assert store.lookup(seq, 0, seq.root) == []  # the failing call marks it down
        out = store.read(metas)
        assert all(isinstance(x, SharedBlockMissingError) for x in out)
        assert store.lookup(seq, 0, seq.root) == []
        assert time.monotonic() - t0 < 2.0
        assert store.describe()["state"] == "down"
        before = store.describe()["dropped_writes"]
        seq2 = seq_of(list(range(500, 500 + 2 * B)))
        for r in records(seq2):
            assert store.put(r) is False
        assert store.describe()["dropped_writes"] == before + 2
        server.start()
        assert wait_for(lambda: store.describe()["state"] == "connected")
        assert store.describe()["num_reconnects"] >= 1
        assert store.lookup(seq, 0, seq.root) == []  # restarted empty
        store_all(store, seq2)  # scripts reloaded after NOSCRIPT
        got = store.lookup(seq2, 0, seq2.root)
        assert len(got) == 2 and not any(isinstance(x, Exception) for x in store.read(got))
    finally:
        store.close()


def test_down_at_start_then_comes_up(tmp_path):
    proc = ValkeyProcess(tmp_path / "late")
    store = ValkeyStore(proc.url, MODEL, timeout_s=0.3, retry_s=0.05)
    try:
        seq = seq_of(list(range(2 * B)))
        assert store.describe()["state"] == "down"
        assert store.lookup(seq, 0, seq.root) == []
        assert store.put(records(seq)[0]) is False
        proc.start()
        assert wait_for(lambda: store.describe()["state"] == "connected")
        store_all(store, seq)
        assert len(store.lookup(seq, 0, seq.root)) == 2
    finally:
        store.close()
        proc.stop()


def test_ttl_expiry_and_touch(server):
    store = ValkeyStore(server.url, MODEL, ttl_s=1.0)
    try:
        seq = seq_of(list(range(3 * B)))
        store_all(store, seq)
        hot = seq_of(list(range(900, 900 + B)))
        store_all(store, hot)
        for _ in range(6):  # keep one block alive by touching it, past the others' TTL
            time.sleep(0.25)
            store.touch([hot.block_hash(0)])
            store.flush()
        assert len(store.lookup(hot, 0, hot.root)) == 1
        metas = store.lookup(seq, 0, seq.root)  # entries outlive values until swept or read
        out = store.read(metas)
        assert all(isinstance(x, SharedBlockMissingError) for x in out)
        assert store.lookup(seq, 0, seq.root) == []  # the read dropped the stale entries
        assert not isinstance(store.read(store.lookup(hot, 0, hot.root))[0], Exception)
        store.check_integrity()
    finally:
        store.close()


def test_stale_entries_swept_by_puts(server):
    store = ValkeyStore(server.url, MODEL, ttl_s=1.0)
    try:
        seq = seq_of(list(range(3 * B)))
        store_all(store, seq)
        time.sleep(0.6)
        kept = seq_of(list(range(300, 300 + B)))
        store_all(store, kept)  # keeps the namespace's index alive
        time.sleep(0.6)
        store_all(store, seq_of(list(range(600, 600 + B))))  # sweeps what is older than a TTL
        assert store.describe()["num_swept"] == 3
        assert store.lookup(seq, 0, seq.root) == []
        assert len(store.lookup(kept, 0, kept.root)) == 1
        store.check_integrity()
    finally:
        store.close()


def test_byte_budget_is_maxmemory_lru(tmp_path):
    # many samples: Valkey's LRU is approximate, and the test checks the newest chain survives
    proc = ValkeyProcess(tmp_path / "lru", "--maxmemory", "4mb", "--maxmemory-policy",
                         "allkeys-lru", "--maxmemory-samples", "64").start()  # fmt: skip
    store = ValkeyStore(proc.url, MODEL)
    try:
        seqs = [seq_of(list(range(k * 1000, k * 1000 + 8 * B))) for k in range(20)]
        for k, s in enumerate(seqs):
            if k == len(seqs) - 1:
                time.sleep(1.1)  # the server's LRU clock ticks once a second: make the last newer
            for r in records(s, width=512):  # 128 KiB blocks
                while not store.put(r):
                    time.sleep(0.001)
            store.flush()
        d = store.describe()
        assert d["bytes_written"] > 4 * d["maxmemory"]  # far more written than fits
        assert d["evicted_keys"] > 0 and d["used_bytes"] <= d["maxmemory"] + 2**20
        assert d["oom_errors"] == 0
        last = seqs[-1]  # the most recent survives; what was evicted reads as missing
        assert not any(
            isinstance(x, Exception) for x in store.read(store.lookup(last, 0, last.root))
        )
        for s in seqs[:5]:
            for x in store.read(store.lookup(s, 0, s.root)):
                assert not isinstance(x, Exception) or isinstance(x, SharedBlockMissingError)
        assert store.describe()["num_corrupt"] == 0
        store.check_integrity()
    finally:
        store.close()
        proc.stop()


def test_full_server_noeviction_counts_oom(tmp_path):
    proc = ValkeyProcess(tmp_path / "oom", "--maxmemory", "3mb",
                         "--maxmemory-policy", "noeviction").start()  # fmt: skip
    store = ValkeyStore(proc.url, MODEL)
    try:
        for k in range(10):
            for r in records(seq_of(list(range(k * 1000, k * 1000 + 8 * B))), width=512):
                store.put(r)
            store.flush()
        d = store.describe()
        assert d["oom_errors"] > 0 and d["state"] == "connected"
        s = seq_of(list(range(0, 8 * B)))
        assert store.read(store.lookup(s, 0, s.root))  # reads still work
    finally:
        store.close()
        proc.stop()


def test_hottest_prefixes_parent_first_within_budget(server):
    store = ValkeyStore(server.url, MODEL)
    try:
        seqs = [
            seq_of(list(range(k * 1000, k * 1000 + 3 * B)), tenant=f"t{k % 2}") for k in range(4)
        ]
        for s in seqs:
            store_all(store, s)
            time.sleep(0.01)
        store.touch([seqs[0].block_hash(2)], root=seqs[0].root)  # the oldest becomes the hottest
        store.flush()
        first = set(seqs[0].full_hashes())
        one_chain = sum(
            e.data_bytes for e in hottest_prefixes(store, 10**9) if e.block_hash in first
        )
        got = hottest_prefixes(store, byte_budget=one_chain)
        assert {m.block_hash for m in got} == first
        got = hottest_prefixes(store, byte_budget=10**9)
        assert len(got) == 12
        seen = {s.root for s in seqs}
        for m in got:  # parent before child
            assert m.meta.parent_hash in seen
            seen.add(m.block_hash)
        out = store.read([m.stored() for m in got])
        assert not any(isinstance(x, Exception) for x in out)
    finally:
        store.close()


def test_hung_server_times_out_then_recovers(server):
    """A server that stops answering (SIGSTOP): one lookup waits out the timeout, then the link
    is down and the next ones return at once; once it answers again the tier reconnects."""
    import os
    import signal

    store = ValkeyStore(server.url, MODEL, timeout_s=0.2, retry_s=0.05)
    try:
        seq = seq_of(list(range(2 * B)))
        store_all(store, seq)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert store.lookup(seq, 0, seq.root) == []
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            for _ in range(20):
                assert store.lookup(seq, 0, seq.root) == []
            assert time.monotonic() - t0 < 0.1
            assert store.describe()["state"] == "down"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: store.describe()["state"] == "connected")
        assert len(store.lookup(seq, 0, seq.root)) == 2
    finally:
        store.close()


def test_full_queue_drops_and_counts_never_blocks(server):
    store = ValkeyStore(server.url, MODEL, queue_blocks=2)
    try:
        seq = seq_of(list(range(64 * B)))
        recs = records(seq, width=256)
        t0 = time.monotonic()
        accepted = sum(store.put(r) for r in recs)
        assert time.monotonic() - t0 < 0.5
        store.flush()
        d = store.describe()
        assert accepted < len(recs) and d["dropped_writes"] == len(recs) - accepted
        assert d["num_writes"] == accepted
        store.check_integrity()
    finally:
        store.close()


def test_damaged_index_entry_is_a_miss(server):
    store = ValkeyStore(server.url, MODEL)
    try:
        seq = seq_of(list(range(3 * B)))
        store_all(store, seq)
        m, _, _ = store.keys.index(seq.root)
        server.client().hset(m, seq.block_hash(1), b"garbage")
        assert [x.meta.depth // B for x in store.lookup(seq, 0, seq.root)] == [0]
        assert store.describe()["errors"] == 0
    finally:
        store.close()


@pytest.mark.slow
def test_cluster_mode(tmp_path):
    """Three primaries: a namespace's index in one slot (hash tag), values spread by block hash;
    the same round trip, verification, warm-up list and integrity check; a primary killed:
    nothing raises, and what it held reads as missing."""
    cluster = ValkeyCluster(tmp_path / "cluster").start()
    store = ValkeyStore(cluster.url, MODEL, timeout_s=0.5, retry_s=0.05)
    try:
        assert store.describe()["state"] == "connected"
        seqs = [seq_of(list(range(k * 1000, k * 1000 + 6 * B)), tenant=f"t{k}") for k in range(3)]
        for s in seqs:
            recs = store_all(store, s)
            got = store.lookup(s, 0, s.root)
            assert [m.block_hash for m in got] == [r.block_hash for r in recs]
            out = store.read(got)
            assert all(same(p, r.payload) for (p, _), r in zip(out, recs, strict=True))
        sizes = [n.client().dbsize() for n in cluster.nodes]
        assert sum(1 for x in sizes if x) >= 2, sizes  # values spread over the primaries
        raw = cluster.nodes[0].client()
        assert raw.execute_command("CLUSTER", "KEYSLOT", store.keys.index(seqs[0].root)[0]) == (
            raw.execute_command("CLUSTER", "KEYSLOT", store.keys.index(seqs[0].root)[2])
        )
        assert len(hottest_prefixes(store, 10**9)) == 18
        store.check_integrity()
        cluster.nodes[2].stop(kill=True)
        t0 = time.monotonic()
        for s in seqs:  # never raises; whatever is answered is verified or missing
            for x in store.read(store.lookup(s, 0, s.root)):
                assert not isinstance(x, Exception) or isinstance(x, SharedBlockMissingError)
        assert time.monotonic() - t0 < 10
        assert store.describe()["num_corrupt"] == 0
    finally:
        store.close()
        cluster.stop()


def test_checkpoint_added_between_lookup_and_read_is_a_race_not_damage(server):
    store = ValkeyStore(server.url, MODEL)
    try:
        seq = seq_of(list(range(2 * B)))
        store_all(store, seq)
        old = store.lookup(seq, 0, seq.root)
        assert not old[1].has_checkpoint
        store_all(store, seq, checkpoint_at={1})  # block 1 rewritten with its checkpoint
        out = store.read(old)
        assert not isinstance(out[0], Exception)
        assert isinstance(out[1], SharedBlockRaceError)
        d = store.describe()
        assert d["num_corrupt"] == 0 and d["num_read_races"] == 1
        new = store.lookup(seq, 0, seq.root)
        assert new[1].has_checkpoint
        payload, ckpt = store.read(new)[1]
        assert ckpt is not None
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["lua", "pipeline"])
def test_lookup_is_the_core_walk_over_the_same_blocks(server, mode):
    """The shared tier picks exactly what ``chain.match_chain`` picks over the same blocks (one
    walk for RAM, SSD and shared): random prompts sharing prefixes, diverging mid-block."""
    from promptcache.core.chain import match_chain

    rng = np.random.default_rng(3)
    store = ValkeyStore(server.url, MODEL, lookup_mode=mode)
    try:
        base = list(range(200, 200 + 6 * B))
        stored: dict = {}
        for k in range(4):  # branches off a common prefix at different points
            cut = int(rng.integers(1, 5 * B))
            toks = base[:cut] + [int(x) for x in rng.integers(1, 50, 6 * B - cut)]
            seq = seq_of(toks)
            for r in store_all(store, seq, seed=k):
                stored[r.block_hash] = r

        class Index:  # every stored block, as a plain in-memory BlockIndex
            def get(self, h):
                r = stored.get(h)
                return None if r is None else store_entry(r)

            def children(self, p, t):
                return [store_entry(r) for r in stored.values()
                        if r.meta.parent_hash == p and r.meta.first_token == t]  # fmt: skip

        def store_entry(r):
            from promptcache.core.tiers.base import StoredBlock

            return StoredBlock(r.meta, r.nbytes, r.checkpoint is not None, r.is_seq_end)

        for _ in range(30):
            cut = int(rng.integers(1, 6 * B))
            q = seq_of(
                base[:cut] + [int(x) for x in rng.integers(1, 50, int(rng.integers(1, 2 * B)))]
            )
            full, tail, _ = match_chain(Index(), q, 0, q.root)
            want = [e.block_hash for e in (full if tail is None else [*full, tail])]
            assert [b.block_hash for b in store.lookup(q, 0, q.root)] == want
    finally:
        store.close()
