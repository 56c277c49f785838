"""Trace shapes built to fool an eviction race, and Mooncake-like chat with knobs (Mooncake
format, generated, seeded): the shapes ``eviction_shapes.py`` and tests/test_eviction_shapes.py
hold the default to.

- ``mooncake_like``: the shape of Mooncake's conversation trace with knobs: every prompt starts
  with one of a few long shared system prompts (Zipf(``skew``) popularity), most requests are
  one-shot (``one_shot`` of them), the rest are turns of short conversations whose prompt is the
  whole history so far. Lengths are log-normal with a long tail (a pasted document).
- ``phase_change``: a hot set of returning documents between one-off prompts (frequency wins),
  then, halfway, a new hot set of growing sessions (recency wins): a policy that learned the
  first phase squats on its blocks in the second.
- ``scan_wave``: a steady hot working set, then a scan of one-off long prompts several times the
  cache, then the working set again: the race must not hand the cache to the scan's winner.
- ``above_capacity``: a cyclic working set a little larger than the cache (LRU gets nothing)
  mixed with a recency-friendly stream of short sessions.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

from trace_parts import History, Ids, Record


def _lognormal_tokens(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(median * rng.lognormvariate(0.0, sigma))))


def mooncake_like(
    seed: int = 0,
    scale: float = 1.0,
    block: int = 512,
    num_systems: int = 3,
    system_tokens: int = 512,
    skew: float = 1.0,
    one_shot: float = 0.6,
    mean_turns: float = 3.0,
    think_s: float = 60.0,
    first_tokens: int = 5_000,
) -> list[Record]:
    """About ``4000 * scale`` requests over an hour: conversations start at a steady rate, each
    with a system prompt (Zipf) and a first message (median ``first_tokens``, tail to 100K);
    a follow-up adds the reply and a message of median 600 tokens."""
    rng, ids = random.Random(seed), Ids()
    systems = [
        ids.run(max(1, int(system_tokens * rng.uniform(0.5, 1.5)) // block))
        for _ in range(num_systems)
    ]
    weights = [1 / (r + 1) ** skew for r in range(num_systems)]
    num_requests = round(4000 * scale)
    mean_len = one_shot + (1 - one_shot) * mean_turns
    gap_s = 3600.0 / (num_requests / mean_len)
    events: list[tuple[float, int]] = []
    t = 0.0
    for k in range(round(num_requests / mean_len)):
        t += rng.expovariate(1 / gap_s)
        events.append((t, k))
    heapq.heapify(events)
    state: dict[int, tuple[History, int]] = {}
    out: list[Record] = []
    while events:
        t, k = heapq.heappop(events)
        if k not in state:
            system = rng.choices(systems, weights)[0]
            h = History(system, len(system) * block, ids)
            h.extend(_lognormal_tokens(rng, first_tokens, 1.0, 100_000), block)
            turns = 1 if rng.random() < one_shot else 2 + int(rng.expovariate(1 / (mean_turns - 2)))
            state[k] = (h, turns)
        h, left = state[k]
        reply = rng.randrange(20, 800)
        out.append(h.record(int(t * 1000), reply))
        if left > 1:
            h.extend(reply + _lognormal_tokens(rng, 600, 1.0, 8_000), block)
            state[k] = (h, left - 1)
            heapq.heappush(events, (t + 5 + think_s * rng.lognormvariate(0, 1.0), k))
        else:
            del state[k]
    return out


def _record(i: int, chain: list[int], block: int) -> Record:
    return {"timestamp": i, "input_length": len(chain) * block - block // 2,
            "output_length": 1, "hash_ids": chain}  # fmt: skip


def phase_change(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """Phase 1: 10 documents of 24 blocks asked about every third request between one-off
    30-block prompts. Phase 2: 24 sessions at a time growing 2-6 blocks a turn, 4-12 turns."""
    rng, ids = random.Random(seed), Ids()
    hot = [ids.run(24) for _ in range(10)]
    n = round(3000 * scale)
    out = [
        _record(i, rng.choice(hot) + ids.run(1) if i % 3 == 0 else ids.run(30), block)
        for i in range(n // 2)
    ]
    active: list[tuple[list[int], int]] = []
    for i in range(n // 2, n):
        while len(active) < 24:
            active.append((ids.run(rng.randrange(4, 20)), rng.randrange(4, 13)))
        j = rng.randrange(len(active))
        chain, left = active[j]
        out.append(_record(i, chain, block))
        chain = chain + ids.run(rng.randrange(2, 7))
        active[j] = (chain, left - 1)
        if left <= 1:
            active.pop(j)
    return out


def scan_wave(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """40% of the trace: 30 documents (Zipf) with one-off questions; 20%: a scan of one-off
    40-block prompts; 40%: the documents again."""
    rng, ids = random.Random(seed), Ids()
    docs = [ids.run(rng.randrange(10, 30)) for _ in range(30)]
    weights = [1 / (r + 1) for r in range(len(docs))]
    n = round(3000 * scale)
    out = []
    for i in range(n):
        if 0.4 * n <= i < 0.6 * n:
            chain = ids.run(40)
        else:
            chain = rng.choices(docs, weights)[0] + ids.run(rng.randrange(1, 3))
        out.append(_record(i, chain, block))
    return out


def above_capacity(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """Every other request the next of 30 prompts of 20 blocks in a fixed cycle (600 blocks);
    between them turns of short growing sessions (8 at a time)."""
    rng, ids = random.Random(seed), Ids()
    cycle = [ids.run(20) for _ in range(30)]
    active: list[tuple[list[int], int]] = []
    out = []
    for i in range(round(3000 * scale)):
        if i % 2 == 0:
            out.append(_record(i, cycle[(i // 2) % len(cycle)], block))
            continue
        while len(active) < 8:
            active.append((ids.run(rng.randrange(2, 8)), rng.randrange(2, 8)))
        j = rng.randrange(len(active))
        chain, left = active[j]
        out.append(_record(i, chain, block))
        active[j] = (chain + ids.run(rng.randrange(1, 4)), left - 1)
        if left <= 1:
            active.pop(j)
    return out


FOOL_SHAPES: dict[str, Callable[..., list[Record]]] = {
    "mooncake_like": mooncake_like,
    "phase_change": phase_change,
    "scan_wave": scan_wave,
    "above_capacity": above_capacity,
}


def footprint(records: list[Record]) -> int:
    """Distinct hash ids: the blocks a cache would need to never evict."""
    return len({h for r in records for h in r["hash_ids"]})  # type: ignore[attr-defined]


def mean_blocks(records: list[Record]) -> float:
    return math.fsum(len(r["hash_ids"]) for r in records) / max(1, len(records))  # type: ignore[arg-type]
