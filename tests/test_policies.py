"""Every eviction policy keeps the tier consistent, and replays are faithful."""

import random

import numpy as np
import pytest
from core_helpers import churn_conversations

from promptcache.core.cache import PromptCache
from promptcache.core.policies import policy_names
from promptcache.core.replay import TraceRequest, null_slicer, prompt_tokens, replay


@pytest.mark.parametrize("policy", policy_names())
def test_long_randomized_run_keeps_integrity(policy):
    rng = random.Random(policy)
    cache = PromptCache("p", block_size=4, ram_budget=64 * 40, policy=policy)
    churn_conversations(cache, rng, steps=3000, check_every=50)
    assert cache.stats().num_evictions > 100


def brute_force_infinite(requests, t):
    """Hit = longest common prefix with any earlier prompt, capped at len - 1."""
    prompts, cached, total = [], 0, 0
    for r in requests:
        toks = prompt_tokens(r, t).tolist()
        best = 0
        for p in prompts:
            n = 0
            for a, b in zip(p, toks, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        cached += min(best, len(toks) - 1)
        total += len(toks)
        prompts.append(toks)
    return cached / total


def hand_made_trace(seed, n=60):
    rng = random.Random(seed)
    convs, next_id, out = [], 1, []
    for i in range(n):
        if convs and rng.random() < 0.6:
            ids = rng.choice(convs)
            ids.extend(range(next_id, next_id + rng.randrange(1, 3)))
        else:
            ids = [0] + list(range(next_id, next_id + rng.randrange(1, 4)))
            convs.append(ids)
        next_id = max(ids) + 1
        length = (len(ids) - 1) * 8 + rng.randrange(1, 9)
        out.append(TraceRequest(i, length, rng.randrange(0, 5), list(ids)))
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", policy_names())
def test_replay_equals_brute_force_when_everything_fits(seed, policy):
    trace = hand_made_trace(seed)
    want = brute_force_infinite(trace, 8)
    got = replay(trace, 10**9, policy=policy, block_size=4, trace_block_tokens=8, check_every=1)
    assert got["hit_rate"] == pytest.approx(want, abs=1e-12)
    assert got["requests"] == len(trace) and got["evicted_blocks"] == 0


def test_replay_lru_tiny_capacity_matches_reference_simulation():
    # capacity of exactly one 8-token prompt: only the immediately previous prompt can hit
    trace = [TraceRequest(i, 8, 0, [0, i % 2 + 1]) for i in range(6)]  # 4 + 4 tokens each
    got = replay(trace, 8, policy="lru", block_size=4, trace_block_tokens=4)
    # requests alternate [0,1],[0,2]: block 0 is shared (4 tokens) after the first request
    assert got["cached_tokens"] == 5 * 4
    assert got["evicted_blocks"] == 5


def test_replay_takes_a_policy_object_and_shows_each_request_first():
    from promptcache.core.policies import make_policy

    trace = hand_made_trace(0)
    seen: list[tuple[int, TraceRequest]] = []
    kwargs = dict(block_size=4, trace_block_tokens=8)
    got = replay(
        trace,
        64,
        policy=make_policy("lru"),
        before_request=lambda i, r: seen.append((i, r)),
        **kwargs,
    )
    assert seen == list(enumerate(trace))
    ref = replay(trace, 64, policy="lru", **kwargs)
    assert (got["policy"], got["cached_tokens"]) == ("lru", ref["cached_tokens"])
    assert ref["cached_tokens"] > 0 and ref["evicted_blocks"] > 0


def test_prompt_tokens_are_deterministic_runs():
    r = TraceRequest(0, 10, 0, [3, 7])
    toks = prompt_tokens(r, 8)
    assert toks.tolist() == list(range(24, 32)) + [56, 57]
    with pytest.raises(ValueError, match="exceeds"):
        prompt_tokens(TraceRequest(0, 100, 0, [1]), 8)
    assert np.array_equal(prompt_tokens(r, 8), toks)


def scan_with_returning_conversations(n=400):
    """5 conversations of 4 blocks that come back every 10 requests, between one-off prompts of
    6 blocks: 46 blocks pass between two visits of a conversation, more than the 40-block
    cache, so recency alone always evicts a conversation just before it returns."""
    convs = [[0, *range(10_000 + 10 * k, 10_003 + 10 * k)] for k in range(5)]
    out, next_id = [], 1
    for i in range(n):
        if i % 2 == 0:
            ids = convs[(i // 2) % 5]
        else:
            ids = [0, *range(next_id, next_id + 5)]
            next_id += 5
        out.append(TraceRequest(i, len(ids) * 8, 0, list(ids)))
    return out


def test_default_policy_keeps_returning_conversations_that_lru_flushes():
    from promptcache.core.policies import DEFAULT_POLICY

    trace = scan_with_returning_conversations()
    kwargs = dict(block_size=8, trace_block_tokens=8, check_every=25)
    lru = replay(trace, 8 * 40, policy="lru", **kwargs)
    best = replay(trace, 8 * 40, policy=DEFAULT_POLICY, **kwargs)
    infinite = replay(trace, 10**9, policy="lru", **kwargs)
    # measured: lru 0.39, frecency 0.478 (the adaptive default follows it), infinite 0.480
    assert best["hit_rate"] > lru["hit_rate"] + 0.05, (best, lru)
    assert 0.95 * infinite["hit_rate"] <= best["hit_rate"] <= infinite["hit_rate"]


def test_replay_reads_multi_turn_sessions_with_accumulated_history(tmp_path):
    """aiperf's multi-turn records: later turns carry only their new tokens and a delay; the
    prompt is the session's history (each turn, then its reply) and then the new tokens."""
    import json

    from promptcache.core.replay import output_tokens, read_trace

    records = [
        {"session_id": "a", "timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]},
        {"session_id": "a", "delay": 10, "input_length": 6, "output_length": 1, "hash_ids": [3]},
        {"session_id": "b", "timestamp": 5, "input_length": 4, "output_length": 2, "hash_ids": [7]},
    ]  # fmt: skip
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    a0, b0, a1 = read_trace(path)
    assert [r.timestamp for r in (a0, b0, a1)] == [0, 5, 10]  # sessions interleave by time
    history = prompt_tokens(a0, 8).tolist() + output_tokens(a0.reply_seed, 3).tolist()
    assert prompt_tokens(a1, 8).tolist() == history + list(range(24, 30))
    assert prompt_tokens(b0, 8).tolist() == list(range(56, 60))
    # with replies saved (as the server does) the second turn hits its whole history
    got = replay([a0, b0, a1], 10**6, block_size=4, trace_block_tokens=8, with_output=True)
    assert got["cached_tokens"] == len(history) == 13


@pytest.mark.parametrize("policy", ["frecency", "taper"])
def test_taper_trims_cold_chains_a_block_per_lap_where_frecency_drops_the_oldest_whole(policy):
    # 20 blocks of 4 tokens: chains A then B fill the tier, then 10 one-off blocks come in
    cache = PromptCache("t", block_size=4, ram_budget=80, policy=policy)

    def chain(first, n):
        return cache.sequence(
            prompt_tokens(TraceRequest(0, 4 * n, 0, list(range(first, first + n))), 4)
        )

    a, b = chain(1, 10), chain(11, 10)
    for seq in [a, b] + [chain(100 + i, 1) for i in range(10)]:
        with cache.lookup(seq):
            pass
        cache.save(seq, None, null_slicer)
        cache.check_integrity()
    with cache.lookup(a) as hit_a:
        kept_a = hit_a.num_tokens // 4
    with cache.lookup(b) as hit_b:
        kept_b = hit_b.num_tokens // 4
    if policy == "frecency":  # the whole older chain went first, the newer one is untouched
        assert (kept_a, kept_b) == (0, 9)  # a lookup leaves the last token to compute
    else:  # each exposed parent waited a lap: both chains lost their tails, neither its head
        assert 0 < kept_a < 10 and 0 < kept_b < 9
