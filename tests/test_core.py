"""Unit tests of the core: hashes, namespaces, bad input, threads, tiers, stats."""

import subprocess
import sys
import threading

import numpy as np
import pytest
from core_helpers import assert_restores, make_slicer

from promptcache.core.budget import cgroup_room_bytes, parse_size
from promptcache.core.cache import PromptCache
from promptcache.core.hashing import HASHERS, Namespace, hash_block, tokens_to_bytes
from promptcache.core.policies import make_policy, policy_names
from promptcache.core.tiers.base import BlockRecord, NullTier
from promptcache.core.tiers.ram.tier import CacheBudgetError

HASH_SCRIPT = """
from promptcache.core.cache import PromptCache
c = PromptCache("fp", block_size=4, ram_budget=10**6)
s = c.sequence(list(range(40)), tenant="t")
print(",".join(s.block_hash(i).hex() for i in range(s.num_full_blocks)))
"""


def test_hashes_identical_across_processes():
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    c = PromptCache("fp", block_size=4, ram_budget=10**6)
    s = c.sequence(list(range(40)), tenant="t")
    assert outs.pop() == ",".join(s.block_hash(i).hex() for i in range(s.num_full_blocks))


def test_chain_depends_on_parent_and_extra():
    root = Namespace("m").root_hash()
    data = tokens_to_bytes([1, 2, 3, 4])
    h1 = hash_block(root, data)
    assert hash_block(h1, data) != h1
    assert hash_block(root, data, b"img") != h1
    assert len({fn(b"x") for fn in HASHERS.values()}) == len(HASHERS)


def test_namespaces_never_share():
    c = PromptCache("model-a", block_size=4, ram_budget=10**6)
    toks = list(range(1, 20))
    c.save(c.sequence(toks, tenant="alice"), None, make_slicer(toks))
    with c.lookup(c.sequence(toks, tenant="bob")) as hit:
        assert hit.num_tokens == 0
    with c.lookup(c.sequence(toks, tenant="alice", salt="s")) as hit:
        assert hit.num_tokens == 0
    with c.lookup(c.sequence(toks, tenant="alice")) as hit:
        assert hit.num_tokens == len(toks) - 1
    other_model = PromptCache("model-b", block_size=4, ram_budget=10**6)
    assert other_model.sequence(toks, tenant="alice").block_hash(0) != c.sequence(
        toks, tenant="alice"
    ).block_hash(0)


def test_extra_keys_split_the_chain_at_their_block():
    c = PromptCache("m", block_size=4, ram_budget=10**6)
    toks = list(range(1, 17))
    c.save(c.sequence(toks, extras={9: b"image-a"}), None, make_slicer(toks))
    with c.lookup(c.sequence(toks, extras={9: b"image-b"})) as hit:
        assert hit.num_tokens == 9  # everything before the image's first token still hits
        assert_restores(hit, toks)
    with c.lookup(c.sequence(toks, extras={8: b"image-b"})) as hit:
        assert hit.num_tokens == 8  # an image at a block's start: the block before it
    with c.lookup(c.sequence(toks, extras={9: b"image-a", 10: b"image-c"})) as hit:
        assert hit.num_tokens == 10  # the first image agrees, the second is new
    with c.lookup(c.sequence(toks, extras={9: b"image-a"})) as hit:
        assert hit.num_tokens == 15


@pytest.mark.parametrize("bad", [[], [1.5, 2.0], [[1, 2]], [-1, 3], ["a"]])
def test_bad_tokens_raise_and_leave_state_intact(bad):
    c = PromptCache("m", block_size=4, ram_budget=10**6)
    toks = list(range(1, 10))
    c.save(c.sequence(toks), None, make_slicer(toks))
    before = c.stats()
    with pytest.raises(ValueError):
        c.lookup(c.sequence(bad))
    with pytest.raises(ValueError):
        c.save(c.sequence(bad), None, make_slicer(toks))
    c.check_integrity()
    assert c.stats() == before


def test_bad_sizes_and_budgets():
    with pytest.raises(ValueError, match="block_size"):
        PromptCache("m", block_size=0)
    with pytest.raises(ValueError, match="not a size"):
        PromptCache("m", ram_budget="lots")
    with pytest.raises(ValueError):
        PromptCache("m", ram_budget=0)
    c = PromptCache("m", block_size=4, ram_budget=100)  # one block is 4 x 2 x 8 = 64 bytes
    toks = list(range(1, 30))
    c.save(c.sequence(toks[:5]), None, make_slicer(toks))
    before = c.stats()
    big = lambda s, e: np.zeros((e - s, 1000))  # noqa: E731
    with pytest.raises(CacheBudgetError, match="exceeds the whole RAM budget"):
        c.save(c.sequence(toks), None, big)
    c.check_integrity()
    assert c.stats().num_blocks == before.num_blocks
    with pytest.raises(ValueError, match="num_tokens"):
        c.save(c.sequence(toks), 99, make_slicer(toks))


def test_parse_size():
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("50%", total_bytes=1000) == 500
    assert parse_size(1234) == 1234
    for bad in ("", "12XB", "-5", "150%", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def write_files(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_memory_cgroup_bounds_the_room_v2_and_v1(tmp_path):
    # cgroup v2: the tightest of the group and the groups above it, file pages it can reclaim aside
    v2 = tmp_path / "v2"
    write_files(v2, {"cgroup.controllers": "cpu memory\n"})
    write_files(v2 / "box", {"memory.max": "8000\n", "memory.current": "1000\n"})
    write_files(
        v2 / "box" / "app",
        {"memory.max": "max\n", "memory.current": "900\n", "memory.stat": "inactive_file 400\n"},
    )
    membership = tmp_path / "cgroup-v2"
    membership.write_text("0::/box/app\n")
    assert cgroup_room_bytes(v2, membership) == 7000  # box: 8000 - 1000; app has no limit
    write_files(v2 / "box" / "app", {"memory.max": "2000\n"})
    assert cgroup_room_bytes(v2, membership) == 1500  # 2000 - (900 - 400)
    # a container sees its own group as the root: a path not mounted falls back to it
    membership.write_text("0::/elsewhere/app\n")
    assert cgroup_room_bytes(v2, membership) is None  # the root has no memory.max
    # cgroup v1 (the memory controller's own hierarchy); its "no limit" is a huge number
    v1 = tmp_path / "v1"
    write_files(
        v1 / "memory", {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "5"}
    )
    write_files(
        v1 / "memory" / "job",
        {
            "memory.limit_in_bytes": "3000\n",
            "memory.usage_in_bytes": "2500\n",
            "memory.stat": "cache 9\ntotal_inactive_file 1000\n",
        },
    )
    membership.write_text("4:memory:/job\n3:cpuset:/\n0::/\n")  # hybrid: v2 without memory
    assert cgroup_room_bytes(v1, membership) == 1500
    membership.write_text("4:memory:/\n")
    assert cgroup_room_bytes(v1, membership) is None
    assert cgroup_room_bytes(v1, tmp_path / "missing") is None  # not Linux: no bound


def test_save_adds_only_new_blocks_and_supersedes_partials():
    c = PromptCache("m", block_size=4, ram_budget=10**6)
    toks = list(range(1, 30))
    calls = []
    slicer = make_slicer(toks)

    def counting(s, e):
        calls.append((s, e))
        return slicer(s, e)

    r1 = c.save(c.sequence(toks[:10]), None, counting)
    assert (r1.num_new_blocks, r1.num_cached_tokens) == (3, 10)
    calls.clear()
    r2 = c.save(c.sequence(toks[:20]), None, counting)
    assert calls == [(8, 12), (12, 16), (16, 20)]
    assert r2.num_new_blocks == 3
    assert c.stats().num_superseded == 1  # the [8, 10) partial is covered by [8, 12)
    c.check_integrity()


class RecordingTier(NullTier):
    name = "recording"
    write_through = False

    def __init__(self):
        self.records: list[BlockRecord] = []

    def put(self, record):
        self.records.append(record)
        return True

    def used_bytes(self):
        return sum(r.nbytes for r in self.records)


def test_eviction_spills_leaves_first_and_pins_hold():
    tier = RecordingTier()
    c = PromptCache("m", block_size=4, ram_budget=64 * 6, next_tier=tier)
    a = list(range(1, 17))  # 4 blocks
    b = list(range(100, 116))
    c.save(c.sequence(a), None, make_slicer(a))
    lease = c.lookup(c.sequence(a))
    c.save(c.sequence(b), None, make_slicer(b))  # needs 4 blocks, only 2 free and a is pinned
    st = c.stats()
    assert st.num_save_skipped_blocks >= 1 and st.num_evictions == 0
    assert c.ram.get(lease.blocks[0].block_hash) is lease.blocks[0]
    lease.release()
    c.save(c.sequence(b), None, make_slicer(b))
    st = c.stats()
    assert st.num_evictions == st.num_spills == len(tier.records) == 2
    # leaves went first: the evicted blocks are a's last two, deepest first
    assert [r.meta.depth for r in tier.records] == [12, 8]
    c.check_integrity()
    with c.lookup(c.sequence(a)) as hit:
        assert hit.num_tokens == 8
        assert_restores(hit, a)


def test_hits_by_kind_and_stats():
    c = PromptCache("m", block_size=4, ram_budget=10**6)
    toks = list(range(1, 12))
    c.save(c.sequence(toks), None, make_slicer(toks))
    kinds = []
    for q in (toks, toks + [50, 51], toks[:5] + [99, 98, 97], toks[:7], [77, 78]):
        with c.lookup(c.sequence(q)) as hit:
            kinds.append(hit.kind)
    assert kinds == ["exact", "prefix", "mid_block", "supersequence", "miss"]
    st = c.stats().to_dict()
    assert st["num_lookups"] == 5 and st["num_hits"] == 4
    assert st["hit_tokens"] == 10 + 11 + 5 + 6
    assert st["hit_rate"] == pytest.approx(32 / (11 + 13 + 8 + 7 + 2), abs=1e-6)


def test_threads_save_and_lookup_concurrently():
    c = PromptCache("m", block_size=8, ram_budget=64 * 2 * 8 * 40)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 50, 40).tolist()
    convs = [system + rng.integers(1, 50, 60).tolist() for _ in range(16)]
    errors = []

    def worker(k):
        try:
            for i in range(60):
                toks = convs[(k + i) % len(convs)][: 20 + (i * 7) % 80]
                seq = c.sequence(toks)
                with c.lookup(seq) as hit:
                    assert_restores(hit, toks)
                c.save(seq, None, make_slicer(toks))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    c.check_integrity()
    st = c.stats()
    assert st.num_lookups == 360 and st.num_hits > 0 and st.num_pinned_blocks == 0


def test_policy_registry():
    assert "lru" in policy_names()
    assert make_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope")
