"""The session-aware eviction rule: what it keeps and evicts in constructed cases, its session
bookkeeping on the real tier, and its hit rate against LRU on generated chat traffic."""

import itertools
import os
import sys

from core_helpers import serve_schedule

from promptcache.core.cache import PromptCache
from promptcache.core.policies import make_policy
from promptcache.core.policies.session import SessionPolicy
from promptcache.core.replay import TraceRequest, null_slicer, prompt_tokens, replay

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from make_traces import SHAPES  # noqa: E402

B = 8  # tokens per block and per trace id


def serve(policy, schedule, capacity_blocks):
    return serve_schedule(policy, schedule, capacity_blocks, B)


def test_a_slow_session_still_due_outlives_a_fast_one_gone_quiet():
    """Session B returns every ~13 blocks of traffic, session A every ~3. A stops; one-off
    prompts fill the cache; B comes back. LRU dropped B (older than A's last turns); the
    session rule knows A is many of its own gaps overdue and B is not yet due."""
    fresh = itertools.count(10_000)
    a, b = [1, 2, 3], [101, 102, 103]
    schedule = []
    for _ in range(4):
        b = [*b, next(fresh)]
        schedule.append(b)
        for _ in range(4):
            a = [*a, next(fresh)]
            schedule += [a, [next(fresh), next(fresh)]]
    schedule += [[next(fresh), next(fresh)] for _ in range(15)]
    schedule.append([*b, next(fresh)])
    got = {p: serve(p, schedule, 40)[-1] for p in ("lru", "session")}
    b_tokens = len(b) * B
    assert got["lru"] < B, got  # LRU flushed B
    assert got["session"] >= b_tokens - 1, got  # all of B (less the recomputed last token)


def test_sessions_follow_turns_branches_and_evictions():
    policy = SessionPolicy()
    cache = PromptCache("t", block_size=B, ram_budget=12 * B, policy=policy)

    def turn(ids):
        seq = cache.sequence(prompt_tokens(TraceRequest(0, len(ids) * B, 0, list(ids)), B))
        cache.lookup(seq).release()
        cache.save(seq, None, null_slicer)
        cache.check_integrity()
        return cache.ram.tree.index[seq.full_hashes()[-1]]

    chat = [1, 2, 3]
    tips = [turn(chat)]
    for k in range(2):  # two more turns, each where the last one left off
        chat = [*chat, 10 + k]
        tips.append(turn(chat))
    session = policy._metas[tips[-1]].session
    assert session.turns == 2 and session.tip is tips[-1]
    assert all(policy._metas[t].session is session for t in tips)  # one session
    other = turn([1, 2, 3, 20, 21])  # a new chat branching off the first turn's prompt
    assert policy._metas[other].session is not session
    assert policy._metas[other].session.turns == 0
    for k in range(4):  # traffic elsewhere evicts the first chat from its tip back
        turn([900 + 3 * k, 901 + 3 * k, 902 + 3 * k])
    assert tips[-1] not in cache.ram.tree.index.values()
    assert session.tip is None or session.tip in cache.ram.tree.index.values()


def test_beats_lru_on_generated_chat_agent_traffic():
    """Short chats and long tool-using agents over shared prompts (benchmarks/chat_shapes.py),
    small, at a budget where LRU flushes the shared prompts between bursts (measured: LRU 0.251,
    the session rule 0.340, frecency the same: the frequency of the shared prompts does it)."""
    rows = SHAPES["chat_agent"](1, 0.15, 64)
    trace = [
        TraceRequest(int(d["timestamp"]), d["input_length"], d["output_length"], d["hash_ids"])
        for d in rows
    ]
    kw = dict(block_size=64, trace_block_tokens=64)
    lru = replay(trace, 60_000, policy="lru", **kw)["hit_rate"]
    got = replay(trace, 60_000, policy=make_policy("session"), check_every=500, **kw)
    assert got["hit_rate"] > lru + 0.05, (got["hit_rate"], lru)
