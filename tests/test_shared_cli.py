"""`promptcache cache ... --shared-tier URL` on a real valkey-server: stats and ls list what
servers stored, verify deletes a damaged value, delete takes a session (shared blocks kept
unless forced; tenants apart) or a whole tenant, clear empties the model's keys."""

from __future__ import annotations

import subprocess
import sys

import pytest
from valkey_helpers import ValkeyProcess, records, server_binary

from promptcache.cli.main import main
from promptcache.core.hashing import Namespace
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import session_key
from promptcache.core.tiers.shared.store import ValkeyStore

pytestmark = [
    pytest.mark.valkey,
    pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary"),
]

MODEL = "c" * 32
B = 8


@pytest.fixture
def valkey(tmp_path):
    proc = ValkeyProcess(tmp_path / "valkey").start()
    yield proc
    proc.stop()


def seq_of(tokens, tenant):
    return TokenSeq(Namespace(MODEL, tenant).root_hash(), tokens, B)


def fill(store):
    """acme: alice and bob share a 2-block prompt; globex: alice's namesake. Returns seqs."""
    system = list(range(2 * B))
    seqs = {
        ("acme", "alice"): seq_of([*system, *range(100, 100 + 2 * B)], "acme"),
        ("acme", "bob"): seq_of([*system, *range(500, 500 + B)], "acme"),
        ("globex", "alice"): seq_of([*system, *range(100, 100 + 2 * B)], "globex"),
    }
    for (tenant, session), seq in seqs.items():
        for r in records(seq):
            assert store.put(r._replace(sessions=frozenset({session_key(tenant, session)})))
    assert store.flush(10)
    return seqs


def cache(capsys, url, *args):
    rc = main(["cache", *args, "--shared-tier", url])
    return rc, capsys.readouterr().out


def reach(store, seq):
    return len(store.lookup(seq, 0, seq.root))


def test_cache_commands_on_the_shared_tier(valkey, capsys):
    store = ValkeyStore(valkey.url, MODEL)
    try:
        seqs = fill(store)
        rc, out = cache(capsys, valkey.url, "stats")
        assert rc == 0 and MODEL[:16] in out
        row = next(line for line in out.splitlines() if line.startswith(MODEL[:16])).split()
        assert row[1:3] == ["2", "9"]  # namespaces; blocks: acme 2 + 2 + 1, globex 2 + 2
        rc, out = cache(capsys, valkey.url, "ls", "--limit", "3")
        assert rc == 0 and "9 blocks" in out and len(out.strip().splitlines()) == 5

        # a session: alice of acme; the prompt she shares with bob stays; globex untouched
        rc, out = cache(capsys, valkey.url, "delete", "--session", "alice", "--tenant", "acme")
        assert rc == 0 and "deleted 2 blocks" in out and "2 shared blocks kept" in out, out
        assert reach(store, seqs["acme", "alice"]) == 2
        assert reach(store, seqs["acme", "bob"]) == 3
        assert reach(store, seqs["globex", "alice"]) == 4
        rc, out = cache(capsys, valkey.url, "delete", "--session", "bob", "--tenant", "acme",
                        "--force")  # fmt: skip
        assert rc == 0 and "deleted 3 blocks" in out, out
        assert reach(store, seqs["acme", "bob"]) == 0

        # verify: a damaged value is found and deleted with its entry
        raw = valkey.client()
        globex = seqs["globex", "alice"]
        key = store.keys.data(globex.block_hash(3))
        value = bytearray(raw.get(key))
        value[-3] ^= 0xFF
        raw.set(key, bytes(value))
        rc, out = cache(capsys, valkey.url, "verify")
        assert rc == 1 and "4 blocks checked, 1 bad" in out, out
        assert reach(store, globex) == 3 and not raw.exists(key)
        rc, out = cache(capsys, valkey.url, "verify")
        assert rc == 0 and "3 blocks checked, 0 bad" in out
        store.check_integrity()

        # a whole tenant, then clear (through the real command line once)
        rc, out = cache(capsys, valkey.url, "delete", "--tenant", "globex")
        assert rc == 0 and "deleted 3 blocks" in out and reach(store, globex) == 0
        fill(store)
        cmd = [sys.executable, "-m", "promptcache.cli", "cache", "clear", "--shared-tier",
               valkey.url]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        assert "cleared 1 model(s)" in out
        assert raw.dbsize() == 0
    finally:
        store.close()


def test_unreachable_shared_tier_is_a_clean_error(capsys):
    rc, out = cache(capsys, "valkey://127.0.0.1:1/0", "stats")
    assert rc == 2 and "unreachable" in out
