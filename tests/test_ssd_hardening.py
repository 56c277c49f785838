"""Issue 13, SSD parts: forged block files, private folders, one process per folder, namespace
records, recovery after write errors, the read/evict race, stats under threads, kill -9 while
the write queue is full. Real files, real SQLite, real processes."""

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from core_helpers import assert_restores, conversation, make_slicer
from safetensors.numpy import save as st_save
from test_ssd import BLOCK, block_file_at, files, make_cache, save, tmpfs

import promptcache.core.block_file as bf
import promptcache.core.tiers.ssd.tier as ssd_module
from promptcache.core.cache import PromptCache
from promptcache.core.tiers.ssd.stats import SsdStats
from promptcache.core.tiers.ssd.tier import SsdTier

REPO = Path(__file__).resolve().parents[1]


def rewrite_meta(path, checksum="keep", **changes):
    """Rewrite a block file's metadata. checksum: "keep" the old field, "v2" recompute it over
    metadata + tensors (what a careful forger would do), "v1" over tensors only (format 1)."""
    data = path.read_bytes()
    header, start = bf._split_header(data)
    meta = dict(header["__metadata__"])
    arrays = {k: v.copy() for k, v in bf.load_arrays(data, header, start).items()}
    meta.update(changes)
    if checksum == "v2":
        meta["checksum"] = bf.checksum_block(meta, arrays)
    elif checksum == "v1":
        h = xxhash.xxh3_128()
        for name in sorted(arrays):
            arr = arrays[name]
            h.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
            h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
        meta["checksum"] = h.hexdigest()
    path.write_bytes(st_save(arrays, metadata=meta))


def drop_index(tier):
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tier.root_dir / name).unlink(missing_ok=True)


def cli(cache_dir, *args):
    return subprocess.run(
        [sys.executable, "-m", "promptcache.cli", "cache", *args, "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


A = list(range(1, 33))  # 8 full blocks
FORGED = [500, 501, 502, 503]  # what the forger writes into the block at depth 8


# -- 6: the checksum covers metadata; re-indexing recomputes the chained hash ------------------


@pytest.mark.parametrize("checksum", ["keep", "v2"])
def test_rewritten_tokens_are_never_reindexed_and_served(tmp_path, checksum):
    """A crash between rename and index update (or a deleted index) makes start-up re-index
    files; one whose tokens were rewritten must not serve its KV to the rewritten prompt."""
    cache, tier = make_cache(tmp_path)
    save(cache, A)
    cache.close()
    rewrite_meta(block_file_at(tier, 8), checksum, tokens=np.array(FORGED, "<u4").tobytes().hex())
    drop_index(tier)
    cache, tier = make_cache(tmp_path)
    query = A[:8] + FORGED + A[12:] + [7]
    with cache.lookup(cache.sequence(query)) as hit:
        assert_restores(hit, query)  # served exactly right, or not at all
        assert hit.num_tokens == 8
    st = cache.stats().tiers["ssd"]
    assert st["num_quarantined"] == 1 and st["num_reindexed"] == 7
    cache.check_integrity()
    cache.close()


def test_cache_verify_checks_metadata_and_the_chained_hash(tmp_path):
    cache, tier = make_cache(tmp_path)
    save(cache, A, tenant="carol")
    cache.close()
    forged = np.array(FORGED, "<u4").tobytes().hex()
    rewrite_meta(block_file_at(tier, 8), "keep", tokens=forged)  # checksum no longer holds
    rewrite_meta(block_file_at(tier, 16), "v2", tokens=forged)  # checksum holds, hash does not
    out = cli(tmp_path / "cache", "verify")
    assert out.returncode == 1 and "8 blocks checked, 2 bad" in out.stdout, out.stdout
    assert "checksum mismatch" in out.stdout and "block hash does not match" in out.stdout
    assert cli(tmp_path / "cache", "verify").returncode == 0


def test_old_format_files_are_removed_not_served(tmp_path):
    """Format 1 (checksum over tensors only) from an older version, index and all: the index is
    dropped at open, every file re-checked, the old ones removed, nothing served."""
    cache, tier = make_cache(tmp_path)
    save(cache, A)
    cache.close()
    for p in files(tier):
        rewrite_meta(p, "v1", version="1")
    db = sqlite3.connect(tier.root_dir / "index.sqlite")
    db.execute("PRAGMA user_version = 0")
    db.close()
    cache, tier = make_cache(tmp_path)
    with cache.lookup(cache.sequence(A + [1])) as hit:
        assert hit.num_tokens == 0
    st = cache.stats().tiers["ssd"]
    assert st["num_old_format_removed"] == 8 and st["num_blocks"] == 0
    assert st["num_quarantined"] == 0 and not files(tier)
    save(cache, A)  # written again in the current format, and served after a restart
    cache.close()
    cache, tier = make_cache(tmp_path)
    with cache.lookup(cache.sequence(A + [1])) as hit:
        assert hit.num_tokens == len(A)
        assert_restores(hit, A)
    cache.check_integrity()
    cache.close()


# -- 7: private folder ------------------------------------------------------------------------


def modes(root):
    out = {}
    for top, dirs, names in os.walk(root):
        for n in dirs + names:
            p = Path(top, n)
            out[str(p.relative_to(root))] = p.stat().st_mode & 0o777
    return out


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_cache_folder_is_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        cache, tier = make_cache(tmp_path)
        save(cache, A, tenant="alice")
        tier.flush()
        tier.quarantine(files(tier)[0], None, "test")  # the quarantine folder too
        cache.close()
    finally:
        os.umask(old)
    cache_dir = tmp_path / "cache"
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    got = modes(cache_dir)
    assert any(k.endswith(".safetensors") for k in got) and any("quarantine" in k for k in got)
    assert any(k.endswith("index.sqlite") for k in got)
    wrong = {
        k: oct(m) for k, m in got.items() if m != (0o700 if (cache_dir / k).is_dir() else 0o600)
    }
    assert not wrong


def test_existing_open_folder_is_tightened_at_start_up(tmp_path):
    cache, tier = make_cache(tmp_path)
    save(cache, A)
    cache.close()
    for top, _dirs, names in os.walk(tmp_path / "cache"):
        os.chmod(top, 0o755)
        for n in names:
            os.chmod(Path(top, n), 0o644)
    cache, tier = make_cache(tmp_path)
    cache.check_integrity()  # asserts every indexed file is 0600
    got = modes(tmp_path / "cache")
    assert all(m in (0o700, 0o600) for m in got.values()), got
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    cache.close()
    # a --cache-dir that holds other things (a home, a project) keeps its mode
    shared = tmp_path / "project"
    shared.mkdir(mode=0o755)
    (shared / "notes.txt").write_text("not ours")
    tier = SsdTier(shared, "model-a")
    assert shared.stat().st_mode & 0o777 == 0o755
    assert tier.root_dir.stat().st_mode & 0o777 == 0o700
    tier.close()


# -- 8: one process per folder ------------------------------------------------------------------

HOLDER = """
import sys, time
from promptcache.core.tiers.ssd.tier import SsdTier
tier = SsdTier(sys.argv[1], "model-a")
print("READY", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def holder(cache_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(cache_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_second_process_on_one_folder_refuses_naming_folder_and_pid(tmp_path):
    cache_dir = tmp_path / "cache"
    with holder(cache_dir) as proc:
        tmp = cache_dir / "model-a" / "default-0" / "00" / ".tmp-x.safetensors.1"
        tmp.parent.mkdir(parents=True)
        tmp.write_bytes(b"the holder's write in flight")
        with pytest.raises(RuntimeError) as err:  # CacheDirLockedError
            SsdTier(cache_dir, "model-a")
        assert str(cache_dir / "model-a") in str(err.value) and f"PID {proc.pid}" in str(err.value)
        assert tmp.exists(), "the refused tier's clean-up deleted the holder's temp file"
        other = SsdTier(cache_dir, "model-b")  # another model's folder: no conflict
        other.close()
        out = cli(cache_dir, "verify")
        assert out.returncode == 2 and f"PID {proc.pid}" in out.stdout, out.stdout
        out = cli(cache_dir, "clear")
        assert out.returncode == 2 and "refused" in out.stdout
        assert (cache_dir / "model-a" / "index.sqlite").exists()
        assert cli(cache_dir, "stats").returncode == 0 and cli(cache_dir, "ls").returncode == 0
        proc.send_signal(signal.SIGKILL)  # the kernel drops the lock with its holder
        proc.wait()
    tier = SsdTier(cache_dir, "model-a")
    assert not tmp.exists()  # now its own start-up cleans the dead writer's temp file
    with pytest.raises(RuntimeError):
        SsdTier(cache_dir, "model-a")  # a second tier in the same process refuses too
    tier.close()
    assert cli(cache_dir, "clear").returncode == 0


# -- 8: namespace records live as long as their blocks ------------------------------------------


def test_namespace_records_are_pruned_with_their_last_block(tmp_path):
    cache, tier = make_cache(tmp_path)
    for t in ("alice", "bob", "carol"):
        save(cache, [ord(t[0]) * 100 + i for i in range(1, 18)], tenant=t)
    for k in range(50):  # lookups only: no block, so no record on disk
        with cache.lookup(cache.sequence([1, 2, 3, 4, 5], tenant=f"visitor-{k}")):
            pass
    tier.flush()
    assert sorted(tier.index.tenants().values()) == ["alice", "bob", "carol"]
    bob = [r for r in tier.index.all_rows() if tier.index.tenants()[r.meta.root] == "bob"]
    for r in sorted(bob, key=lambda r: -r.meta.depth):  # leaf first, like eviction
        tier.quarantine(tier.root_dir / r.path, r, "test")
    assert sorted(tier.index.tenants().values()) == ["alice", "carol"]
    cache.check_integrity()
    cache.close()
    cache, tier = make_cache(tmp_path, retention_s=0.0)
    time.sleep(0.01)
    tier.enforce_capacity()
    assert tier.index.tenants() == {} and tier.describe()["num_blocks"] == 0
    cache.check_integrity()
    cache.close()


# -- 8: the tier comes back after write errors --------------------------------------------------


def test_tier_off_at_start_up_comes_back_when_the_folder_is_usable(tmp_path, monkeypatch):
    monkeypatch.setattr(ssd_module, "RETRY_S", 0.1, raising=False)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    tier = SsdTier(blocker, "model-a")
    cache = PromptCache("model-a", block_size=BLOCK, ram_budget=10**6, next_tier=tier)
    save(cache, A)
    st = cache.stats().tiers["ssd"]
    assert st["enabled"] is False and st["write_state"] == "backing_off" and st["last_error"]
    blocker.unlink()
    deadline = time.time() + 5
    while not tier.is_enabled and time.time() < deadline:
        time.sleep(0.02)
    b = list(range(100, 133))
    save(cache, b)
    tier.flush()
    st = cache.stats().tiers["ssd"]
    assert st["enabled"] and st["num_recoveries"] == 1 and st["write_state"] == "ok"
    assert st["num_blocks"] == 9  # b's 8 full blocks and its 1-token tail
    cache.check_integrity()
    cache.close()


def test_real_full_disk_backs_off_then_writes_again(tmp_path, monkeypatch):
    monkeypatch.setattr(ssd_module, "RETRY_S", 0.1, raising=False)
    with tmpfs(tmp_path / "small", "1m") as mnt:
        junk = mnt / "junk"
        with contextlib.suppress(OSError), open(junk, "wb") as f:
            f.write(b"x" * 2**22)  # the disk is full before the server starts
        tier = SsdTier(mnt, "model-a")
        cache = PromptCache("model-a", block_size=BLOCK, ram_budget=10**8, next_tier=tier)
        assert not tier.is_enabled
        junk.unlink()
        deadline = time.time() + 5
        while not tier.is_enabled and time.time() < deadline:
            time.sleep(0.02)
        save(cache, A)
        tier.flush()
        assert cache.stats().tiers["ssd"]["num_blocks"] == 8
        with contextlib.suppress(OSError), open(junk, "wb") as f:
            f.write(b"x" * 2**22)  # full again while serving
        for k in range(5):
            save(cache, [1000 * (k + 1) + i for i in range(1, 60)])
        tier.flush()
        st = cache.stats().tiers["ssd"]
        assert st["write_errors"] >= 1 and "No space left" in st["last_error"]
        junk.unlink()
        time.sleep(max(0.0, st["retry_in_s"]) + 0.05)
        c = list(range(7000, 7033))
        save(cache, c)
        tier.flush()
        st = cache.stats().tiers["ssd"]
        assert st["write_state"] == "ok" and st["num_recoveries"] >= 2, st
        cache.check_integrity()
        cache.close()
        tier = SsdTier(mnt, "model-a")
        cache = PromptCache("model-a", block_size=BLOCK, ram_budget=10**8, next_tier=tier)
        with cache.lookup(cache.sequence(c + [1])) as hit:
            assert hit.num_tokens == len(c)
            assert_restores(hit, c)
        cache.close()


# -- 8: reads race with eviction ----------------------------------------------------------------


def test_block_evicted_between_lookup_and_read_is_not_quarantined(tmp_path):
    cache, tier = make_cache(tmp_path)
    save(cache, A)
    cache.close()
    cache, tier = make_cache(tmp_path)
    seq = cache.sequence(A + [1])
    rows = tier.lookup(seq, 0, seq.root, False)
    assert len(rows) == 8
    tier.budget_bytes = 0
    tier.enforce_capacity()  # evicts every block after the lookup found them
    results = tier.read(rows)
    assert all(isinstance(r, bf.CorruptBlockError) for r in results)
    st = tier.describe()
    assert st["num_quarantined"] == 0 and not tier.quarantine_dir.exists()
    assert st["num_read_races"] == 8
    cache.check_integrity()
    cache.close()


def records(cache, seq):
    from promptcache.core.tiers.base import BlockRecord

    return [BlockRecord.from_block(b) for b in cache.ram.tree.full_path(seq, seq.num_full_blocks)]


def test_reads_under_concurrent_eviction_and_rewrite(tmp_path):
    cache, tier = make_cache(tmp_path)
    save(cache, A)
    tier.flush()
    seq = cache.sequence(A + [1])
    rows = tier.lookup(seq, 0, seq.root, False)
    payloads = {r.block_hash: make_slicer(A)(r.meta.depth, r.meta.depth + BLOCK) for r in rows}
    stop = threading.Event()
    good, wrong = [0], []

    def reader():
        while not stop.is_set():
            for r in rows:
                result = tier.read([r])[0]
                if isinstance(result, bf.CorruptBlockError):
                    continue
                payload, _ = result
                if np.array_equal(payload, payloads[r.block_hash]):
                    good[0] += 1
                else:  # an assert here would die with its thread unseen
                    wrong.append(r.meta.depth)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    recs = records(cache, seq)
    deadline = time.time() + 0.6
    while time.time() < deadline:  # evict every file, then write them all again
        tier.budget_bytes = 0
        tier.enforce_capacity()
        tier.budget_bytes = 10**9
        for rec in recs:
            tier.put(rec)
        tier.flush()
    stop.set()
    for t in threads:
        t.join()
    assert good[0] > 0 and not wrong and tier.describe()["num_quarantined"] == 0
    cache.check_integrity()
    cache.close()


# -- 8: stats under threads ---------------------------------------------------------------------


def test_stats_snapshots_are_consistent_while_threads_update_them():
    stats = SsdStats()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            stats.observe_reload(1.0, 1)

    threads = [threading.Thread(target=work) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for _ in range(500):
            d = stats.to_dict()
            assert d["reload_bytes"] == d["reload_seconds"] == sum(d["reload_histogram"].values())
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(old)
    adders = [
        threading.Thread(target=lambda: [stats.add(num_hits=1) for _ in range(5000)])
        for _ in range(4)
    ]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    assert stats.to_dict()["num_hits"] == 20000


# -- kill -9 while the write queue is full ------------------------------------------------------

WRITER = """
import sys, threading, time
sys.path.insert(0, sys.argv[3])
from core_helpers import conversation, make_slicer
import promptcache.core.tiers.ssd.write as ssd_write
from promptcache.core.cache import PromptCache
from promptcache.core.tiers.ssd.tier import SsdTier

real_commit = ssd_write.commit_temp
lock = threading.Lock()

def say(line):  # whole lines: the writer thread and the main thread both report
    with lock:
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

def slow_commit(tmp, path):  # announce and widen both crash windows
    say("TEMP")  # a temp file is on disk
    time.sleep(0.05)
    real_commit(tmp, path)
    say("RENAMED")  # the block file is in place, its index row not yet
    time.sleep(0.05)

ssd_write.commit_temp = slow_commit
tier = SsdTier(sys.argv[1], "model-k", queue_blocks=100_000)
cache = PromptCache("model-k", block_size=4, ram_budget=10**8, next_tier=tier)
k = int(sys.argv[2])
while True:
    toks = conversation(k)
    cache.save(cache.sequence(toks), None, make_slicer(toks))
    say(f"SAVED {k} {tier.num_queued_writes}")
    k += 1
"""


def test_kill_9_with_writes_queued_recovers_every_time(tmp_path):
    cache_dir = tmp_path / "cache"
    tests_dir = str(Path(__file__).parent)
    saved: list[int] = []
    totals = {"num_temp_removed": 0, "num_reindexed": 0, "num_rows_dropped": 0}
    next_k, rounds, served = 0, 0, 0
    while rounds < 6:
        rounds += 1
        window = "TEMP" if rounds % 2 else "RENAMED"  # each crash window, three times
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(cache_dir), str(next_k), tests_dir],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            queued = 0
            while True:  # kill with a backlog of writes, inside this round's window
                line = proc.stdout.readline()
                assert line, "the writer died"
                if line.startswith("SAVED"):
                    _, k, num = line.split()
                    saved.append(int(k))
                    queued = int(num)
                elif queued >= 40 and line.strip() == window:
                    break
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        next_k = saved[-1] + 1
        tier = SsdTier(cache_dir, "model-k")  # the kernel released the dead writer's lock
        cache = PromptCache("model-k", block_size=4, ram_budget=10**8, next_tier=tier)
        assert not list(cache_dir.rglob(".tmp-*")), f"round {rounds}: temp files survived"
        cache.check_integrity()
        for k in saved[-20:]:
            query = conversation(k) + [9]
            with cache.lookup(cache.sequence(query)) as hit:
                assert_restores(hit, query)  # exactly what an uncached run computes, or nothing
                served += hit.num_tokens
        st = cache.stats().tiers["ssd"]
        assert st["num_quarantined"] == 0
        for key in totals:
            totals[key] += st[key]
        cache.close()
    assert totals["num_temp_removed"] and totals["num_reindexed"], (rounds, totals)
    assert served > 0
    out = cli(cache_dir, "verify")
    assert out.returncode == 0, out.stdout
