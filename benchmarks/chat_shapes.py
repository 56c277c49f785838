"""Chat-shaped replay traces (Mooncake format), generated: the shapes where a frequency policy
squats and where bursts of one system prompt crowd out the others.

- ``chat_bursts``: many short chat sessions (1-6 turns) over a few long shared system prompts
  (1K-8K tokens, Zipf popularity), the sessions of one prompt arriving in bursts (a campaign, a
  team starting work). A session's history is hot for a minute and dead after.
- ``chat_agent``: the same chat traffic with long tool-using agent sessions (a 10K-token tools
  prefix, 20-200 turns, history growing each turn) running through it.
- ``diurnal``: chat sessions whose arrival rate swings 10x over a compressed day, twice; the
  popular system prompts change with the time of day.
- ``scan_bursts``: chat traffic interrupted by batch scans: hundreds of one-off long prompts
  (documents under a short instruction) fired within a minute, never seen again.

Every shape is at 512 tokens per hash id (the Mooncake trace's block) by default; sizes are such
that 1M, 3.1M and 10M cached tokens span small to nearly all of the reusable part.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

from trace_parts import History, Ids, Record

# a session: (start s, shared prefix ids, prefix tokens, number of turns, mean think s, kind)
Session = tuple[float, list[int], int, int, float, str]


def _system_prompts(rng: random.Random, ids: Ids, block: int, n: int) -> list[list[int]]:
    return [ids.run(rng.randrange(1_000, 8_000) // block) for _ in range(n)]


def _turns(rng: random.Random, mean: float, cap: int) -> int:
    """1 + geometric: most chats are a question or two, a few go on."""
    p = 1 / mean
    return min(cap, 1 + int(math.log(1 - rng.random()) / math.log(1 - p)) if p < 1 else 1)


def play(rng: random.Random, ids: Ids, block: int, sessions: list[Session]) -> list[Record]:
    """Each session's turns in time order, all sessions interleaved: a turn's prompt is the
    prefix, then every earlier message and reply of the session, then the new message."""
    events = [(s[0], k) for k, s in enumerate(sessions)]
    heapq.heapify(events)
    state: dict[int, tuple[History, int]] = {}
    out: list[Record] = []
    while events:
        t, k = heapq.heappop(events)
        _, prefix, prefix_tokens, turns, think_s, kind = sessions[k]
        if k not in state:
            h = History(prefix, prefix_tokens, ids)
            # a pasted document or code file in a quarter of the chats
            first = rng.randrange(2_000, 24_000) if rng.random() < 0.5 else rng.randrange(50, 1_500)
            h.extend(first if kind != "agent" else rng.randrange(500, 3_000), block)
            state[k] = (h, turns)
        h, left = state[k]
        reply = rng.randrange(100, 800) if kind == "chat" else rng.randrange(50, 400)
        out.append(h.record(int(t * 1000), reply))
        if left > 1:
            new = rng.randrange(30, 600) if kind == "chat" else rng.randrange(200, 4_000)
            h.extend(reply + new, block)  # the reply, then the next message (or tool result)
            state[k] = (h, left - 1)
            # reading and typing: log-normal, a median of ``think_s``, a tail of many minutes
            heapq.heappush(events, (t + 2 + think_s * rng.lognormvariate(0, 1.0), k))
        else:
            del state[k]
    return out


def _chat_sessions(
    rng: random.Random,
    systems: list[list[int]],
    block: int,
    num_bursts: int,
    rate: Callable[[float], float] = lambda t: 1.0,
    popularity: Callable[[float], list[float]] | None = None,
) -> list[Session]:
    """Bursts of sessions, each burst over one system prompt (Zipf popularity unless
    ``popularity(t)`` says otherwise), bursts arriving at ``rate(t)`` times twenty a minute."""
    zipf = [1 / (r + 1) for r in range(len(systems))]
    out: list[Session] = []
    t = 0.0
    for _ in range(num_bursts):
        t += rng.expovariate(rate(t) / 3.0)
        weights = popularity(t) if popularity else zipf
        system = rng.choices(systems, weights)[0]
        for _ in range(rng.randrange(5, 40)):
            start = t + rng.expovariate(1 / 10.0)
            out.append((start, system, len(system) * block, _turns(rng, 2.0, 12), 120.0, "chat"))
    return out


def chat_bursts(
    seed: int = 0, scale: float = 1.0, block: int = 512, num_systems: int = 6
) -> list[Record]:
    rng, ids = random.Random(seed), Ids()
    systems = _system_prompts(rng, ids, block, num_systems)
    return play(rng, ids, block, _chat_sessions(rng, systems, block, round(150 * scale)))


def chat_agent(seed: int = 0, scale: float = 1.0, block: int = 512) -> list[Record]:
    rng, ids = random.Random(seed), Ids()
    systems = _system_prompts(rng, ids, block, 6)
    sessions = _chat_sessions(rng, systems, block, round(100 * scale))
    end = max(s[0] for s in sessions)
    tools = ids.run(10_000 // block)
    for _ in range(round(25 * scale)):
        turns = int(math.exp(rng.uniform(math.log(20), math.log(200))))
        sessions.append((rng.uniform(0, end), tools, len(tools) * block, turns, 20.0, "agent"))
    return play(rng, ids, block, sessions)


def diurnal(seed: int = 0, scale: float = 1.0, block: int = 512) -> list[Record]:
    rng, ids = random.Random(seed), Ids()
    systems = _system_prompts(rng, ids, block, 8)
    day_s = 3_600.0  # one compressed day: two of them in the trace

    def rate(t: float) -> float:
        return 0.2 + 1.8 * (0.5 - 0.5 * math.cos(2 * math.pi * t / day_s))

    def popularity(t: float) -> list[float]:  # the day's first half favours the first prompts
        phase = (t % day_s) / day_s
        return [1 / (1 + abs(k / len(systems) - phase) * 8) ** 2 for k in range(len(systems))]

    sessions = _chat_sessions(rng, systems, block, round(140 * scale), rate, popularity)
    return play(rng, ids, block, sessions)


def scan_bursts(seed: int = 0, scale: float = 1.0, block: int = 512) -> list[Record]:
    rng, ids = random.Random(seed), Ids()
    systems = _system_prompts(rng, ids, block, 5)
    sessions = _chat_sessions(rng, systems, block, round(120 * scale))
    out = play(rng, ids, block, sessions)
    end = max(int(r["timestamp"]) for r in out)  # type: ignore[call-overload]
    instruction = ids.run(2)
    for _ in range(max(1, round(4 * scale))):
        t0 = rng.uniform(0, end)
        for j in range(rng.randrange(150, 400)):
            h = History(instruction, len(instruction) * block, ids)
            h.extend(rng.randrange(2_000, 12_000), block)
            out.append(h.record(int(t0 + j * 150), rng.randrange(20, 200)))
    out.sort(key=lambda r: r["timestamp"])  # type: ignore[arg-type, return-value]
    return out


CHAT_SHAPES: dict[str, Callable[..., list[Record]]] = {
    "chat_bursts": chat_bursts,
    "chat_agent": chat_agent,
    "diurnal": diurnal,
    "scan_bursts": scan_bursts,
}
