"""Sessions, deletion and TTL expiry in the core: RAM and a real SSD tier (files, SQLite)."""

import sqlite3

from core_helpers import assert_restores, make_slicer

from promptcache.core.cache import PromptCache
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK = 4
BLOCK_BYTES = BLOCK * 2 * 8
SYSTEM = list(range(1, 17))  # 4 full blocks every session shares


class FakeClock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def make_cache(tmp_path, clock=None, ram_blocks=200, **kw):
    clock = clock or FakeClock()
    tier = SsdTier(tmp_path / "cache", "model-a", clock=clock)
    cache = PromptCache(
        "model-a", block_size=BLOCK, ram_budget=BLOCK_BYTES * ram_blocks, next_tier=tier,
        clock=clock, **kw,
    )  # fmt: skip
    return cache, tier


def use(cache, tokens, session="", tenant="", ttl=None):
    """A request: look up, then save the whole sequence (as the engine does)."""
    seq = cache.sequence(tokens, tenant=tenant, session=session, ttl_s=ttl)
    with cache.lookup(seq) as hit:
        n = hit.num_tokens
        assert_restores(hit, tokens)
    cache.save(seq, None, make_slicer(tokens))
    return n


def hit(cache, tokens, tenant=""):
    with cache.lookup(cache.sequence(tokens + [7], tenant=tenant)) as h:
        return h.num_tokens


def ssd_files(tier):
    return sorted(p for p in tier.root_dir.rglob("*.safetensors") if "quarantine" not in p.parts)


def tag_rows(tier):
    db = sqlite3.connect(tier.root_dir / "index.sqlite")
    try:
        return db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
    finally:
        db.close()


def test_delete_session_keeps_shared_blocks_and_leaves_other_sessions_hitting(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = SYSTEM + [100 + i for i in range(12)]
    b = SYSTEM + [200 + i for i in range(12)]
    use(cache, a, "alice")
    use(cache, b, "bob")  # hits the shared system prompt: tags it "bob" too
    tier.flush()
    report = cache.delete_session("alice").to_dict()
    assert report["removed"]["ram"]["blocks"] == 3 and report["removed"]["ssd"]["blocks"] == 3
    assert report["removed"]["ssd"]["bytes"] > 0
    assert report["shared_blocks_kept"] == 4
    assert hit(cache, a) == len(SYSTEM)  # alice's own blocks are gone, the system prompt stays
    assert hit(cache, b) == len(b)
    cache.check_integrity()
    # forced: bob's deletion takes the shared blocks and everything below them
    report = cache.delete_session("bob", force=True).to_dict()
    assert report["removed"]["ram"]["blocks"] == 7 and report["shared_blocks_kept"] == 0
    assert hit(cache, b) == 0 and ssd_files(tier) == [] and tag_rows(tier) == 0
    cache.check_integrity()
    cache.close()


def test_delete_session_after_a_restart_removes_files_and_rows(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = SYSTEM + [100 + i for i in range(12)]
    b = SYSTEM + [200 + i for i in range(12)]
    use(cache, a, "alice")
    use(cache, b, "bob")
    cache.close()
    cache, tier = make_cache(tmp_path)  # the blocks are on SSD only now
    assert len(ssd_files(tier)) == 10
    report = cache.delete_session("alice").to_dict()
    assert report["removed"]["ssd"]["blocks"] == 3 and report["shared_blocks_kept"] == 4
    assert len(ssd_files(tier)) == 7
    assert hit(cache, a) == len(SYSTEM) and hit(cache, b) == len(b)
    cache.check_integrity()
    cache.close()


def test_sessions_live_inside_their_tenant(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = SYSTEM + [100 + i for i in range(12)]
    use(cache, a, "s1", tenant="acme")
    report = cache.delete_session("s1", tenant="globex").to_dict()  # same id, other tenant
    assert report["removed_blocks"] == 0 and hit(cache, a, "acme") == len(a)
    report = cache.delete_tenant("acme").to_dict()
    assert report["removed"]["ram"]["blocks"] == 7 and report["removed"]["ssd"]["blocks"] == 7
    assert hit(cache, a, "acme") == 0 and ssd_files(tier) == []
    cache.check_integrity()
    cache.close()


def test_pinned_blocks_are_kept_and_reported(tmp_path):
    cache, tier = make_cache(tmp_path)
    a = SYSTEM + [100 + i for i in range(12)]
    use(cache, a, "alice")
    with cache.lookup(cache.sequence(a + [1])):
        report = cache.delete_session("alice").to_dict()
    assert report["pinned_blocks_kept"] == 7 and report["removed"]["ram"]["blocks"] == 0
    cache.check_integrity()
    cache.close()


def test_ram_ttl_expires_unused_blocks_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    cache = PromptCache(
        "m", block_size=BLOCK, ram_budget=BLOCK_BYTES * 100, ram_ttl=60, clock=clock
    )
    a, b = SYSTEM + [100, 101, 102, 103], [50 + i for i in range(8)]
    use(cache, a)
    clock.t += 40
    use(cache, b)
    clock.t += 30  # a: unused for 70 s, b: 30 s
    assert hit(cache, b) == len(b)  # the lookup runs the sweep
    assert hit(cache, a) == 0
    st = cache.stats()
    assert st.num_expired == 5 and st.to_dict()["num_expired"] == 5
    cache.check_integrity()


def test_ttl_hints_expire_blocks_in_ram_and_on_ssd(tmp_path):
    clock = FakeClock()
    cache, tier = make_cache(tmp_path, clock)
    a = SYSTEM + [100 + i for i in range(12)]
    b = [300 + i for i in range(8)]
    use(cache, a, ttl=300.0)  # Anthropic "5m"
    use(cache, b)  # no hint, no --ram-ttl: lives until evicted
    tier.flush()
    clock.t += 301
    counts = cache.expire()
    assert counts == {"ram": 7, "ssd": 7}
    assert hit(cache, a) == 0 and hit(cache, b) == len(b)
    assert len(ssd_files(tier)) == 2
    assert cache.stats().tiers["ssd"]["num_expired"] == 7
    cache.check_integrity()
    cache.close()


def test_a_longer_hint_of_a_later_request_keeps_the_shared_blocks(tmp_path):
    clock = FakeClock()
    cache, tier = make_cache(tmp_path, clock)
    a = SYSTEM + [100 + i for i in range(4)]
    b = SYSTEM + [200 + i for i in range(4)]
    use(cache, a, ttl=300.0)
    use(cache, b, ttl=3600.0)  # its system prompt blocks now live an hour
    tier.flush()
    clock.t += 600
    cache.expire()
    assert hit(cache, a) == len(SYSTEM) and hit(cache, b) == len(b)
    cache.check_integrity()
    cache.close()
