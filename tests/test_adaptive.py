"""The default (adaptive) policy against every fixed policy on each adversarial trace shape, the
miniature simulations against full-size replays, hand-overs between policies, and the what-if
curve in the stats."""

import logging
import math
import os
import random
import sys

import pytest

from promptcache.core.cache import PromptCache
from promptcache.core.minisim import MiniCache, sampled_indices
from promptcache.core.policies import DEFAULT_POLICY, make_policy, policy_names
from promptcache.core.policies.adaptive import CANDIDATES, AdaptivePolicy
from promptcache.core.replay import TraceRequest, null_slicer, prompt_tokens, replay

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from make_traces import SHAPES  # noqa: E402

FIXED = [p for p in policy_names() if p != DEFAULT_POLICY]


def shape_trace(name, scale, block, **kw):
    return [
        TraceRequest(int(d["timestamp"]), d["input_length"], d["output_length"], d["hash_ids"])
        for d in SHAPES[name](1, scale, block, **kw)
    ]


SMALL_AGENTS = dict(num_sessions=30, concurrency=16, token_scale=0.1)
# (shape, scale, trace block tokens, capacity in blocks, generator options): small enough to
# run in seconds, at a capacity where the fixed policies differ
CASES = [
    ("coding_agent", 0.1, 64, 400, SMALL_AGENTS),
    ("scan_hot", 0.5, 8, 200, {}),
    ("loop", 0.5, 8, 600, {}),
    ("zipf", 0.4, 8, 600, {}),
    ("shared_prefix", 0.15, 8, 400, {}),
    ("chat_bursts", 0.1, 64, 1500, {}),  # short chats over a few system prompts, in bursts
]


@pytest.mark.parametrize(
    ("shape", "scale", "block", "capacity", "options"), CASES, ids=[c[0] for c in CASES]
)
def test_default_within_001_of_best_fixed_policy(shape, scale, block, capacity, options):
    trace = shape_trace(shape, scale, block, **options)
    kw = dict(block_size=block, trace_block_tokens=block)
    fixed = {p: replay(trace, capacity * block, policy=p, **kw)["hit_rate"] for p in FIXED}
    got = replay(trace, capacity * block, policy=DEFAULT_POLICY, **kw)
    best = max(fixed, key=fixed.__getitem__)
    assert got["hit_rate"] >= fixed[best] - 0.01, (got, fixed)
    # the shape has signal: the fixed policies disagree, and the default picked the winner
    if max(fixed.values()) - min(fixed.values()) > 0.02:
        assert fixed[got["policy_leader"]] >= fixed[best] - 0.01, (got, fixed)


def aligned_trace(seed, n=500, block=8):
    """Conversations over a shared prefix with whole-block prompts (no partial blocks)."""
    rng = random.Random(seed)
    convs, next_id, out = [], 10, []
    for i in range(n):
        if convs and rng.random() < 0.7:
            ids = rng.choice(convs)
            ids.extend(range(next_id, next_id + rng.randrange(1, 3)))
        else:
            ids = [0, 1] + list(range(next_id, next_id + rng.randrange(1, 5)))
            convs.append(ids)
        next_id = max(ids) + 1
        out.append(TraceRequest(i, len(ids) * block, 0, list(ids)))
    return out


@pytest.mark.parametrize("policy", FIXED)
def test_unsampled_miniature_equals_the_full_size_cache(policy):
    """At sampling rate 1 a miniature runs the same policy on the same tree: hit for hit the
    same as the real cache (whose lookups stop one token short of a full hit)."""
    block, capacity = 8, 40
    trace = aligned_trace(3)
    cache = PromptCache("m", block_size=block, ram_budget=capacity * block, policy=policy)
    mini = MiniCache(make_policy(policy), capacity, block)
    for i, req in enumerate(trace):
        seq = cache.sequence(prompt_tokens(req, block))
        with cache.lookup(seq) as hit:
            live_blocks = -(-hit.num_tokens // block)
        (chain,) = [
            [seq.full_hashes()[j] for j in c] for c in sampled_indices(seq.full_hashes(), [256])
        ]
        assert mini.lookup(chain) == live_blocks, i
        cache.save(seq, None, null_slicer)
        mini.save(seq.root, chain)
        if i % 50 == 0:
            mini.check_integrity()
            cache.check_integrity()
    assert cache.stats().num_evictions > 100


def one_off_tails_trace(seed, n=600, block=8):
    """Questions on a few shared documents: each prompt is a document and a one-off half block
    (a partial last block), a third of them asked again word for word."""
    rng = random.Random(seed)
    docs = [list(range(100 * d, 100 * d + rng.randrange(2, 6))) for d in range(12)]
    asked, out = [], []
    for i in range(n):
        if asked and rng.random() < 0.3:
            ids = rng.choice(asked)
        else:
            ids = rng.choice(docs) + [10_000 + i]
            asked.append(ids)
        out.append(TraceRequest(i, len(ids) * block - block // 2, 0, list(ids)))
    return out


@pytest.mark.parametrize("policy", FIXED)
def test_unsampled_miniature_with_partial_blocks_equals_the_full_size_cache(policy):
    """A prompt's partial last block takes the live budget and is evicted like any block: at
    sampling rate 1 a miniature that holds it too (its hash is the last of the chain, its
    size the fraction of a block it holds) is hit for hit the real cache."""
    block, capacity = 8, 40
    cache = PromptCache("m", block_size=block, ram_budget=capacity * block, policy=policy)
    mini = MiniCache(make_policy(policy), capacity, block)
    for i, req in enumerate(one_off_tails_trace(4)):
        seq = cache.sequence(prompt_tokens(req, block))
        tail = seq.num_tokens % block / block
        chain = [*seq.full_hashes(), seq.partial_hash(seq.num_tokens)]
        with cache.lookup(seq) as hit:
            got = mini.lookup(chain, tail) * block
            # a full hit leaves the last token to compute
            assert got == hit.num_tokens or got == seq.num_tokens == hit.num_tokens + 1, i
        cache.save(seq, None, null_slicer)
        mini.save(seq.root, chain, tail)
        if i % 50 == 0:
            mini.check_integrity()
            cache.check_integrity()
    assert cache.stats().num_evictions > 100


def test_sampled_chains_form_a_prefix_tree():
    cache = PromptCache("s", block_size=4, ram_budget=1 << 20)
    a = cache.sequence(list(range(400)))
    b = cache.sequence(list(range(200)) + [7] * 200)
    (sa,), (sb,) = sampled_indices(a.full_hashes(), [64]), sampled_indices(b.full_hashes(), [64])
    shared = [i for i in sa if i < 50]
    assert sb[: len(shared)] == shared and 0 < len(sa) < 100  # about 1 in 4 blocks
    (all_a,) = sampled_indices(a.full_hashes(), [256])
    assert all_a == list(range(100))
    (sparse,) = sampled_indices(a.full_hashes(), [16])
    assert set(sparse) <= set(sa)


def test_miniature_ranking_matches_full_size_on_a_long_trace():
    """Sampled at 1/8, the miniatures rank the policies as full-size replays do."""
    trace = shape_trace("scan_hot", 1.0, 8)
    kw = dict(block_size=8, trace_block_tokens=8)
    cap = 1024 * 8  # 1024 blocks: sampled at 1/8 (128 blocks)
    fixed = {p: replay(trace, cap, policy=p, **kw)["hit_rate"] for p in CANDIDATES}
    got = replay(trace, cap, policy=DEFAULT_POLICY, **kw)
    assert got["whatif_sample_rate"] < 1
    est = got["whatif_sampled_hit_rate_by_policy"]
    # the miniatures' favourite is as good as the best at full size, their loser the worst
    assert fixed[max(est, key=est.__getitem__)] >= max(fixed.values()) - 0.01, (est, fixed)
    assert min(est, key=est.__getitem__) == min(fixed, key=fixed.__getitem__), (est, fixed)


class Flipper(AdaptivePolicy):
    """Hands the cache to the next candidate every few evictions."""

    def __init__(self):
        super().__init__()
        self.num_pops = 0
        self.pop_victim = self._pop

    def _pop(self):
        self.num_pops += 1
        if self.num_pops % 7 == 0:  # mid-eviction: the block being extended is pinned
            self.hand_over((self.current + 1) % len(self.candidate_names))
            self.pop_victim = self._pop
        return self.policy.pop_victim()


def test_hand_overs_keep_the_tier_consistent():
    from core_helpers import churn_conversations

    rng = random.Random(5)
    policy = Flipper()
    cache = PromptCache("f", block_size=4, ram_budget=64 * 30, policy=policy)
    cache.whatif.on_switch = None  # only the flipper hands over
    churn_conversations(cache, rng, steps=1500, check_every=25)
    assert policy.num_pops > 100


def test_whatif_curve_in_stats_and_a_logged_recommendation(caplog):
    """A loop of 600 blocks through a 400-block cache: 2x would hold it all."""
    block = 16
    trace = shape_trace("loop", 1.0, block)  # 40 prompts x 20 blocks, one shared
    cache = PromptCache("w", block_size=block, ram_budget=500 * block)
    with caplog.at_level(logging.WARNING, logger="promptcache.whatif"):
        for req in trace:
            seq = cache.sequence(prompt_tokens(req, block))
            with cache.lookup(seq):
                pass
            cache.save(seq, None, null_slicer)
    stats = cache.stats().to_dict()
    curve = stats["whatif_hit_rate_by_budget"]
    assert curve["2x"] > curve["1x"] + 0.3 and curve["0.5x"] <= curve["1x"]
    assert stats["policy"] == "adaptive" and stats["policy_leader"] in CANDIDATES
    assert stats["policy_race"] == "fast"  # the slow race only where the fast one churned
    assert any("2x" in r.getMessage() for r in caplog.records)

    from promptcache.core.figures import render_series

    text = "\n".join(render_series(cache.stats().series(), "promptcache_cache_"))
    assert 'promptcache_cache_whatif_hit_rate_by_budget{budget="2x"}' in text
    assert f'promptcache_cache_policy_leader{{policy="{stats["policy_leader"]}"}} 1' in text
    assert f'promptcache_cache_policy_race{{race="{stats["policy_race"]}"}} 1' in text


def test_small_cache_miniatures_are_sampled_and_the_curve_shares_the_leaders():
    """A 150-block cache turns over every few requests: its miniatures run at 1/2 (not at full
    size, which would cost each candidate the live cache's upkeep), and the curve's 1x is the
    leader's candidate miniature rather than a copy of it."""
    block = 8
    trace = shape_trace("scan_hot", 0.2, block)
    cache = PromptCache("t", block_size=block, ram_budget=150 * block)
    for req in trace:
        seq = cache.sequence(prompt_tokens(req, block))
        with cache.lookup(seq):
            pass
        cache.save(seq, None, null_slicer)
    whatif = cache.whatif
    assert whatif.rates == (2, 2)
    assert len(whatif.live.sims) == len(CANDIDATES) and len(whatif.curve.sims) == 2
    assert whatif._curve_rate(1) == whatif.live.rate(whatif.leader)
    for sim in [*whatif.live.sims, *whatif.curve.sims]:
        sim.check_integrity()
    curve = cache.stats().to_dict()["whatif_hit_rate_by_budget"]
    assert curve["0.5x"] <= curve["1x"] <= curve["2x"]


@pytest.mark.parametrize(
    ("num_blocks", "rate"), [(40, 1), (150, 2), (6000, 2), (8000, 2), (20000, 8)]
)
def test_miniatures_sample_one_block_in_two_unless_that_holds_over_4096(num_blocks, rate):
    """The candidates' miniatures sample 1 block in 2: at 1/8 a 6,000-block cache's miniatures
    misranked frecency and S3-FIFO. Only a huge cache's are sparser, at most 4,096 blocks each."""
    from promptcache.core.whatif import WhatIf

    whatif = WhatIf(num_blocks * 1000, 16, CANDIDATES)
    whatif.note_saved(1000, 16)  # one block of 16 tokens takes 1,000 bytes
    assert whatif.rates[0] == rate
    for sim in whatif.live.sims:
        assert num_blocks / rate - 1 <= sim.budget / sim.unit <= min(num_blocks / rate, 4096)


def test_a_frecency_leader_keeps_the_hand_over_state_itself():
    """Under frecency the adaptive policy keeps no residents or history of its own (frecency
    keeps the same): a hand-over takes them from frecency, hit counts and all."""
    from core_helpers import churn_conversations

    policy = AdaptivePolicy(("frecency", "lru", "s3fifo"))
    cache = PromptCache("k", block_size=4, ram_budget=64 * 30, policy=policy)
    cache.whatif.on_switch = None
    assert policy.on_insert == policy.policy.on_insert  # called directly
    churn_conversations(cache, random.Random(3), steps=400, check_every=50)
    assert not policy._resident and not policy._history
    resident, history = policy.policy.hand_over_state()
    assert resident and history
    policy.hand_over(1)  # to lru: now tracked here, from frecency's state
    assert policy._resident.keys() == resident.keys() and policy._history == history
    churn_conversations(cache, random.Random(4), steps=200, check_every=50)
    policy.hand_over(0)  # back to frecency, which adopts the history kept meanwhile
    assert policy.policy._history and not policy._history
    churn_conversations(cache, random.Random(5), steps=200, check_every=50)


def test_frecency_handed_the_cache_back_counts_every_blocks_uses_as_before():
    """A resident block's uses from before its last insertion (a system prompt evicted and
    saved again) travel with it through a hand-over: frecency -> LRU -> frecency with no
    request between counts every block's uses as the first frecency did (they were dropped:
    a returned block ranked as new; on the held-out chat trace, .002 of hit rate)."""
    from core_helpers import churn_conversations

    policy = AdaptivePolicy(("frecency", "lru", "s3fifo"))
    cache = PromptCache("u", block_size=4, ram_budget=64 * 30, policy=policy)
    cache.whatif.on_switch = None
    churn_conversations(cache, random.Random(6), steps=400, check_every=50)
    first = policy.policy
    uses = {b: m.base_freq for b, m in first._metas.items()}
    assert max(uses.values()) > 1  # some blocks returned
    policy.hand_over(1)
    policy.hand_over(0)
    back = policy.policy
    assert back is not first
    assert {b: m.base_freq for b, m in back._metas.items()} == uses
    cache.check_integrity()
    churn_conversations(cache, random.Random(7), steps=100, check_every=25)


def test_frecency_handed_the_cache_back_starts_from_the_reuse_intervals_measured_meanwhile():
    """The adaptive policy measures reuse intervals under any leader (a frecency leader into the
    same estimate): frecency back in charge starts from them, not from its first observation,
    and a fixed frecency fed the same requests measures the same window."""
    from core_helpers import churn_conversations

    policy = AdaptivePolicy(("frecency", "lru", "s3fifo"))
    cache = PromptCache("r", block_size=4, ram_budget=64 * 30, policy=policy)
    cache.whatif.on_switch = None
    fixed = PromptCache("r", block_size=4, ram_budget=64 * 30, policy="frecency")
    for c, seed in ((cache, 3), (fixed, 3)):
        churn_conversations(c, random.Random(seed), steps=300, check_every=50)
    first = policy.policy
    assert first.window_bytes > 0
    assert first.window_bytes == fixed.ram.policy.window_bytes  # one estimate, same requests
    policy.hand_over(0)  # frecency to a fresh frecency: the window carries over exactly
    assert policy.policy is not first and policy.policy.window_bytes == first.window_bytes
    policy.hand_over(2)  # s3fifo: the intervals are measured here meanwhile
    before = policy._reuse.log_gap
    churn_conversations(cache, random.Random(4), steps=300, check_every=50)
    assert policy._reuse.log_gap != before
    policy.hand_over(0)
    back = policy.policy
    assert back.window_bytes == back.reuse_windows * math.exp(policy._reuse.log_gap) > 0
    churn_conversations(cache, random.Random(5), steps=200, check_every=50)
    assert policy.policy is back and back._reuse is policy._reuse  # measured in the shared one


def test_a_sampled_frecency_learns_its_reuse_window_at_the_full_size_pace():
    """A miniature holds 1 block in R, so each block it sees stands for R: its frecency weighs
    an observed reuse interval R times (``sample_at``), and after the workload's reuse
    intervals change its window follows as the full-size cache's does. Weighed once, it lagged
    R times behind (at 1/8: the held-out chat trace's cold start, coding agents)."""
    block, rate = 8, 4
    rng = random.Random(5)
    cache = PromptCache("w", block_size=block, ram_budget=400 * block, policy="frecency")
    minis = {r: MiniCache(make_policy("frecency"), 100, block, r) for r in (rate, 1)}
    docs = [list(range(1000 * d, 1000 * d + 30)) for d in range(60)]
    for i in range(501):
        # short reuse first (4 documents asked in turn), then long (60, at random)
        ids = [*(docs[i % 4] if i < 300 else rng.choice(docs)), 10**6 + i]
        seq = cache.sequence(prompt_tokens(TraceRequest(i, len(ids) * block, 0, ids), block))
        hashes = seq.full_hashes()
        (chain,) = [[hashes[j] for j in c] for c in sampled_indices(hashes, [256 // rate])]
        with cache.lookup(seq):
            pass
        cache.save(seq, None, null_slicer)
        for mini in minis.values():
            mini.lookup(chain)
            mini.save(seq.root, chain)
        if i in (400, 500):  # 100 and 200 requests after the change
            full = math.log(cache.ram.policy.window_bytes)
            # a miniature's clock runs R times slower (1 block in R inserted)
            got = {r: math.log(m.policy.window_bytes * rate) for r, m in minis.items()}
            assert abs(got[rate] - full) < 0.5, (i, full, got)
            assert got[1] < full - 1.0, (i, full, got)  # weighed once: far behind
    for mini in minis.values():
        mini.check_integrity()


def test_the_namespace_moves_the_miniatures_sample_but_no_fixed_policy():
    """Every block hash covers the cache's name: under another name the miniatures sample other
    blocks (which is why eviction_shapes --samples replays the default under several), while
    a fixed policy, which never looks at the hashes' values, decides the same."""
    block = 8
    trace = shape_trace("scan_hot", 0.2, block)
    kw = dict(block_size=block, trace_block_tokens=block)
    for policy in ("lru", "frecency", "s3fifo"):
        a, b = (replay(trace, 150 * block, policy=policy, name=n, **kw) for n in ("a", "b"))
        assert a["cached_tokens"] == b["cached_tokens"] > 0
    caches = [PromptCache(n, block_size=block, ram_budget=150 * block) for n in ("a", "b")]
    seqs = [c.sequence(prompt_tokens(trace[0], block)) for c in caches]
    assert seqs[0].full_hashes() != seqs[1].full_hashes()
