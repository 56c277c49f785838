"""The shared tier's session tags and sweeps on a real valkey-server: tags written with the
blocks are found by another store that never saw them, shared blocks stay unless forced,
tenants stay apart, tags expire with their blocks, and sweeps reach the eviction log."""

from __future__ import annotations

import time

import pytest
from valkey_helpers import ValkeyCluster, ValkeyProcess, records, server_binary

from promptcache.core.evictions import EvictionLog
from promptcache.core.hashing import Namespace
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import BlockUse, session_key
from promptcache.core.tiers.shared.index import session_id
from promptcache.core.tiers.shared.store import ValkeyStore

pytestmark = [
    pytest.mark.valkey,
    pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary"),
]

MODEL = "e" * 32
B = 8


@pytest.fixture
def server(tmp_path):
    proc = ValkeyProcess(tmp_path / "valkey").start()
    yield proc
    proc.stop()


def seq_of(tokens, tenant=""):
    return TokenSeq(Namespace(MODEL, tenant).root_hash(), tokens, B)


def put_tagged(store, seq, *sessions, seed=0):
    recs = [r._replace(sessions=frozenset(sessions)) for r in records(seq, seed=seed)]
    for r in recs:
        assert store.put(r)
    assert store.flush(10)
    return [r.block_hash for r in recs]


def reach(store, seq):
    return len(store.lookup(seq, 0, seq.root))


@pytest.mark.parametrize("cluster", [False, True])
def test_another_store_finds_and_deletes_a_session(server, tmp_path, cluster):
    """Store A writes two sessions' chains sharing a system prompt (one via put, one via a tag
    after a hit); store B, fresh, finds each session's blocks, deletes one session's own blocks
    and keeps the shared prefix; forced, the prefix goes too."""
    nodes = ValkeyCluster(tmp_path / "cluster").start() if cluster else None
    url = nodes.url if nodes else server.url
    a, b = ValkeyStore(url, MODEL), ValkeyStore(url, MODEL)
    try:
        alice, bob = session_key("acme", "alice"), session_key("acme", "bob")
        system = list(range(2 * B))
        sa = seq_of([*system, *range(100, 100 + 3 * B)], "acme")
        sb = seq_of([*system, *range(500, 500 + 2 * B)], "acme")
        ha = put_tagged(a, sa, alice)
        hb = put_tagged(a, sb)  # bob's own blocks: untagged puts, then tagged by a hit
        a.tag(hb, BlockUse(bob), time.time(), sb.root)
        assert a.flush(10)
        got_a, got_b = b.session_blocks(alice), b.session_blocks(bob)
        assert set(got_a) == set(ha) and set(got_b) == set(hb)
        assert {h for h, shared in got_a.items() if shared} == set(ha[:2])  # the system prompt
        assert b.session_blocks(session_key("globex", "alice")) == {}  # another tenant's id
        # unforced: alice's own blocks go, the shared prefix stays
        own = [h for h, shared in got_a.items() if not shared]
        assert b.delete_blocks(own)[0] == 3
        b.forget_session(alice)
        assert reach(b, sa) == 2 and reach(b, sb) == 4
        assert b.session_blocks(alice) == {}
        assert set(b.session_blocks(bob)) == set(hb)  # bob's tags stay
        assert b.session_blocks(bob)[hb[0]] is False  # alice's id left the shared blocks
        b.check_integrity()
        # forced: bob's whole chain, shared prefix included (and what hangs below it)
        assert b.delete_blocks(list(b.session_blocks(bob)))[0] == 4
        b.forget_session(bob)
        assert reach(a, sa) == 0 and reach(a, sb) == 0
        b.check_integrity()
    finally:
        a.close()
        b.close()
        if nodes:
            nodes.stop()


def test_tags_expire_with_their_blocks(server):
    store = ValkeyStore(server.url, MODEL, ttl_s=1.0)
    try:
        key = session_key("", "s1")
        seq = seq_of(list(range(2 * B)))
        put_tagged(store, seq, key)
        raw = server.client()
        assert raw.pttl(store.keys.session(session_id(key))) > 0
        assert raw.pttl(store.keys.tags(seq.root)) > 0
        time.sleep(1.3)
        assert not raw.exists(store.keys.session(session_id(key)), store.keys.tags(seq.root))
        assert store.session_blocks(key) == {}
    finally:
        store.close()


def test_stale_sweep_noted_in_the_eviction_log(server):
    """Entries a put sweeps (unused for a TTL) are evictions: a later miss can say so."""
    log = EvictionLog()
    store = ValkeyStore(server.url, MODEL, ttl_s=1.0, evictions=log)
    try:
        old = seq_of(list(range(2 * B)))
        put_tagged(store, old, session_key("", "s"))
        time.sleep(0.6)
        put_tagged(store, seq_of(list(range(300, 300 + B))))  # keeps the index alive
        time.sleep(0.6)
        assert len(log) == 0
        put_tagged(store, seq_of(list(range(600, 600 + B))))  # sweeps the old chain
        assert store.describe()["num_swept"] == 2
        for i in range(2):
            ev = log.find(old.block_hash(i), old.block_hash(i - 1) if i else old.root)
            assert ev is not None and ev.tier == "shared"
        assert not server.client().hexists(store.keys.tags(old.root), old.block_hash(0))
        store.check_integrity()
    finally:
        store.close()
