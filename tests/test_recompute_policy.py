"""Recompute-cost-aware eviction and the compute-saved replay metric: a deep block outlives a
shallow one of the same recency and use, a huge attention context makes the rule frecency, and
compute saved weighs a hit by the prefill it skips (deeper tokens cost more)."""

import math

import pytest
from core_helpers import serve_schedule

from promptcache.core.policies.recompute import RecomputePolicy
from promptcache.core.replay import TraceRequest, prefill_cost, replay

B = 8


def serve(policy, schedule, capacity_blocks):
    return serve_schedule(policy, schedule, capacity_blocks, B)


def schedule():
    """A prompt reused a few times (frecency learns its reuse window), a deep conversation
    (12 blocks) used once, a newer shallow prompt (1 block), one-off prompts that force three
    blocks out; then the deep and the shallow prompts come back."""
    deep, shallow = list(range(1, 13)), [500]
    warm = [[700], [701], [700], [702], [700]]
    return [*warm, deep, shallow, [900], [901], deep, shallow]


def test_a_deep_leaf_outlives_a_newer_shallow_one():
    # 3 + 12 + 1 + 2 blocks into 14: the single-use leaves go first, oldest first (frecency:
    # the deep tail goes before the shallow prompt) or cheapest to recompute first
    frecency = serve("frecency", schedule(), 14)[-2:]
    recompute = serve(RecomputePolicy(attention_context=B), schedule(), 14)[-2:]
    deep_tokens = 12 * B - 1  # a full hit stops one token short
    assert frecency[0] < deep_tokens  # recency alone drops the deep tail
    # the deep tail's last block costs ~12x a first block to recompute: the shallow one goes
    assert recompute == [deep_tokens, 0]


def test_a_huge_attention_context_is_frecency():
    trace = [list(range(k, k + 1 + k % 7)) for k in range(0, 400, 3)] * 3
    assert serve(RecomputePolicy(attention_context=10**12), trace, 40) == serve(
        "frecency", trace, 40
    )


def test_prefill_cost_and_compute_saved():
    assert prefill_cost(0) == 0 and prefill_cost(1, 10) == 1
    assert prefill_cost(4, 2) == pytest.approx(4 + (0 + 1 + 2 + 3) / 2)
    ids = list(range(10, 18))
    trace = [TraceRequest(0, 8 * B, 0, ids), TraceRequest(1, 8 * B, 0, ids)]
    r = replay(trace, 100 * B, policy="lru", block_size=B, trace_block_tokens=B,
               attention_context=16)  # fmt: skip
    hit = r["cached_tokens"]
    assert hit == 8 * B - 1
    assert r["compute_saved"] == pytest.approx(
        prefill_cost(hit, 16) / (2 * prefill_cost(8 * B, 16))
    )
    # the hit skips the shallow tokens and the last one, the dearest: a little under hit rate
    assert r["compute_saved"] < r["hit_rate"]
    assert math.isclose(r["hit_rate"], hit / (16 * B))
