"""SSD tier with real safetensors files and real SQLite: restarts, damage, capacity, faults."""

import contextlib
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from core_helpers import assert_restores, make_slicer

import promptcache.core.tiers.ssd.write as ssd_writes
from promptcache.core.cache import PromptCache
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK = 4
BLOCK_BYTES = BLOCK * 2 * 8  # make_slicer rows: (token, position) int64


def make_cache(tmp_path, ram_blocks=100, model="model-a", **kw):
    tier = SsdTier(tmp_path / "cache", model, **kw)
    return PromptCache(
        model, block_size=BLOCK, ram_budget=BLOCK_BYTES * ram_blocks, next_tier=tier
    ), tier


def files(tier):
    return sorted(p for p in tier.root_dir.rglob("*.safetensors") if "quarantine" not in p.parts)


def save(cache, tokens, tenant=""):
    cache.save(cache.sequence(tokens, tenant=tenant), None, make_slicer(tokens))


def test_restart_serves_from_ssd_and_equals_saved_state(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = list(range(1, 40))
    save(cache, a)
    cache.close()
    cache, tier = make_cache(tmp_path)
    assert len(files(tier)) == len(a) // BLOCK + 1
    query = a + [99]
    with cache.lookup(cache.sequence(query)) as hit:
        assert hit.num_tokens == len(a)
        assert_restores(hit, query)
    st = cache.stats()
    assert (
        st.tiers["ssd"]["num_hits"] == 1
        and st.tiers["ssd"]["num_promoted_blocks"] == len(a) // BLOCK + 1
    )
    cache.check_integrity()
    cache.close()


def test_ram_evictions_are_served_back_from_ssd(tmp_path):
    cache, tier = make_cache(tmp_path, ram_blocks=4)
    a, b = list(range(1, 17)), list(range(100, 117))
    save(cache, a)
    save(cache, b)  # evicts a's blocks from RAM
    tier.flush()
    assert cache.stats().num_evictions >= 3
    with cache.lookup(cache.sequence(a + [5])) as hit:
        assert hit.num_tokens == 16
        assert_restores(hit, a)
    cache.check_integrity()
    cache.close()


def test_tenants_stay_apart_on_disk(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = list(range(1, 30))
    save(cache, a, tenant="alice")
    cache.close()
    cache, tier = make_cache(tmp_path)
    with cache.lookup(cache.sequence(a, tenant="bob")) as hit:
        assert hit.num_tokens == 0
    with cache.lookup(cache.sequence(a, tenant="alice")) as hit:
        assert hit.num_tokens == len(a) - 1
    assert {p.parts[-3].split("-")[0] for p in files(tier)} == {"alice"}
    cache.close()


def damage_then_lookup(tmp_path, damage):
    cache, tier = make_cache(tmp_path)
    a = list(range(1, 33))  # 8 full blocks
    save(cache, a)
    cache.close()
    damage(tier, files(tier))
    cache, tier = make_cache(tmp_path)
    query = a + [7]
    with cache.lookup(cache.sequence(query)) as hit:
        assert_restores(hit, query)  # whatever is served is exactly right
        served = hit.num_tokens
    cache.check_integrity()
    st = cache.stats().tiers["ssd"]
    cache.close()
    return served, st, tier


def block_file_at(tier, depth):
    for p in files(tier):
        if f'"depth":"{depth}"' in p.read_bytes()[:4096].decode("latin-1"):
            return p
    raise AssertionError(f"no block file at depth {depth}")


def test_truncated_file_is_quarantined_and_the_hit_ends_there(tmp_path):
    def damage(tier, paths):
        p = block_file_at(tier, 12)
        p.write_bytes(p.read_bytes()[:-20])

    served, st, tier = damage_then_lookup(tmp_path, damage)
    assert served == 12 and st["num_quarantined"] == 1
    assert len(list(tier.quarantine_dir.iterdir())) == 1


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    def damage(tier, paths):
        p = block_file_at(tier, 8)
        data = bytearray(p.read_bytes())
        data[-3] ^= 0xFF
        p.write_bytes(bytes(data))

    served, st, _ = damage_then_lookup(tmp_path, damage)
    assert served == 8 and st["num_quarantined"] == 1


def test_deleted_index_is_rebuilt_from_valid_files(tmp_path):
    def damage(tier, paths):
        for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
            (tier.root_dir / name).unlink(missing_ok=True)
        data = bytearray(paths[3].read_bytes())
        data[-1] ^= 0x01
        paths[3].write_bytes(bytes(data))

    served, st, _ = damage_then_lookup(tmp_path, damage)
    assert st["num_reindexed"] == 7 and st["num_quarantined"] == 1
    assert 0 <= served < 32


def test_file_from_another_model_is_quarantined(tmp_path):
    other, other_tier = make_cache(tmp_path / "b", model="model-b")
    b = list(range(1, 33))
    save(other, b)
    other.close()
    foreign = files(other_tier)[0]

    def damage(tier, paths):
        target = paths[0].parent / foreign.name
        target.write_bytes(foreign.read_bytes())

    _, st, _ = damage_then_lookup(tmp_path, damage)
    assert st["num_quarantined"] >= 1


def test_stray_temp_files_and_rows_without_files_are_cleaned(tmp_path):
    def damage(tier, paths):
        (paths[0].parent / ".tmp-deadbeef.safetensors.123").write_bytes(b"half a file")
        paths[-1].unlink()

    _, st, tier = damage_then_lookup(tmp_path, damage)
    assert st["num_temp_removed"] == 1 and st["num_rows_dropped"] == 1
    assert not list(tier.root_dir.rglob(".tmp-*"))


def test_capacity_evicts_lru_leaves_and_retention_expires(tmp_path):
    cache, tier = make_cache(tmp_path, budget_bytes=10**9)
    save(cache, list(range(1, 5)))
    tier.flush()
    one_file = files(tier)[0].stat().st_size
    cache.close()
    cache, tier = make_cache(tmp_path, budget_bytes=one_file * 6)
    for k in range(5):
        save(cache, [50 * k + i for i in range(1, 17)])
    tier.flush()
    tier.enforce_capacity()
    cache.check_integrity()
    assert tier.describe()["num_evictions"] > 0 and tier.used_bytes() <= one_file * 6
    cache.close()
    cache, tier = make_cache(tmp_path, retention_s=0.0)
    time.sleep(0.01)
    tier.enforce_capacity()
    assert tier.describe()["num_blocks"] == 0 and tier.describe()["num_expired"] > 0
    cache.close()


def test_full_queue_drops_writes_without_blocking(tmp_path, monkeypatch):
    real = ssd_writes.write_temp

    def slow(path, data):
        time.sleep(0.05)
        return real(path, data)

    monkeypatch.setattr(ssd_writes, "write_temp", slow)
    cache, tier = make_cache(tmp_path, queue_blocks=2)
    t0 = time.perf_counter()
    a = list(range(1, 81))  # 20 blocks
    save(cache, a)
    assert time.perf_counter() - t0 < 0.5
    assert tier.stats.dropped_writes > 0
    with cache.lookup(cache.sequence(a)) as hit:  # RAM still serves everything
        assert hit.num_tokens == len(a) - 1
    cache.close()


def test_disk_full_keeps_serving_from_ram(tmp_path, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ssd_writes, "write_temp", full)
    cache, tier = make_cache(tmp_path)
    a = list(range(1, 41))
    save(cache, a)
    tier.flush()
    with cache.lookup(cache.sequence(a)) as hit:
        assert hit.num_tokens == len(a) - 1
        assert_restores(hit, a)
    st = cache.stats().tiers["ssd"]
    assert st["write_errors"] > 0 and "No space left" in st["last_error"]
    cache.check_integrity()
    cache.close()


@contextlib.contextmanager
def tmpfs(path, size):
    """A real small filesystem (root only); skips the test where mounting is not allowed."""
    if os.geteuid() != 0 or sys.platform != "linux":
        pytest.skip("needs root on Linux to mount a tmpfs")
    path.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if subprocess.run(cmd, capture_output=True).returncode:
        pytest.skip("tmpfs mount not permitted here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_real_full_tmpfs(tmp_path):
    with tmpfs(tmp_path / "small", "256k") as mnt:
        tier = SsdTier(mnt, "model-a")
        cache = PromptCache("model-a", block_size=BLOCK, ram_budget=10**8, next_tier=tier)
        for k in range(40):
            toks = [1000 * k + i for i in range(1, 200)]
            save(cache, toks)
            with cache.lookup(cache.sequence(toks)) as hit:
                assert hit.num_tokens == len(toks) - 1
        tier.flush()
        assert cache.stats().tiers["ssd"]["write_errors"] > 0
        cache.close()


def test_unusable_cache_dir_disables_the_tier_not_the_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    tier = SsdTier(blocker / "cache", "model-a")
    cache = PromptCache("model-a", block_size=BLOCK, ram_budget=10**6, next_tier=tier)
    a = list(range(1, 20))
    save(cache, a)
    with cache.lookup(cache.sequence(a)) as hit:
        assert hit.num_tokens == len(a) - 1
    st = cache.stats().tiers["ssd"]
    assert st["enabled"] is False and st["last_error"]
    cache.close()


def test_promotion_failure_when_ram_cannot_be_reserved(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = list(range(1, 33))
    save(cache, a)
    cache.close()
    cache, tier = make_cache(tmp_path, ram_blocks=6)
    b = list(range(200, 224))  # 6 blocks, all pinned below
    save(cache, b)
    lease = cache.lookup(cache.sequence(b + [1]))
    with cache.lookup(cache.sequence(a + [1])) as hit:
        assert hit.num_tokens == 0
    assert cache.stats().tiers["ssd"]["promotion_failures"] == 1
    lease.release()
    cache.check_integrity()
    cache.close()


def test_cache_cli_stats_ls_sessions_verify_clear(tmp_path):
    cache, tier = make_cache(tmp_path)
    save(cache, list(range(1, 33)), tenant="carol")
    dave = list(range(300, 316))
    cache.save(cache.sequence(dave, tenant="dave", session="s-1"), None, make_slicer(dave))
    cache.close()
    data = bytearray(files(tier)[2].read_bytes())
    data[-2] ^= 0xFF
    files(tier)[2].write_bytes(bytes(data))

    def run(*a):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "promptcache.cli",
                "cache",
                *a,
                "--cache-dir",
                str(tmp_path / "cache"),
            ],
            capture_output=True,
            text=True,
        )

    out = run("stats")
    assert out.returncode == 0 and " 12 " in out.stdout
    out = run("ls")
    assert out.returncode == 0 and "carol" in out.stdout
    out = run("sessions")
    assert out.returncode == 0 and "1 session(s)" in out.stdout, out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("s-1"))
    assert row[:3] == ["s-1", "dave", str(len(dave) // BLOCK)], row
    out = run("verify")
    assert out.returncode == 1 and "12 blocks checked, 1 bad" in out.stdout
    assert run("verify").returncode == 0
    assert run("clear").returncode == 0
    assert not list(Path(tmp_path / "cache").rglob("*.safetensors"))


def test_read_only_cache_dir(tmp_path):
    with tmpfs(tmp_path / "ro", "4m") as mnt:
        cache, tier = make_cache(mnt)
        a = list(range(1, 33))
        save(cache, a)
        cache.close()
        assert (
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode
            == 0
        )
        cache, tier = make_cache(mnt)
        b = list(range(100, 133))
        save(cache, b)  # cannot be written: the RAM tier still serves it
        with cache.lookup(cache.sequence(b)) as hit:
            assert hit.num_tokens == len(b) - 1
            assert_restores(hit, b)
        with cache.lookup(
            cache.sequence(a + [1])
        ) as hit:  # old blocks: served exactly, or not at all
            assert_restores(hit, a + [1])
        if tier.index is not None:
            tier.flush()
        st = cache.stats().tiers["ssd"]
        assert st["write_errors"] > 0 or st["enabled"] is False
        assert st["last_error"]
        cache.close()
