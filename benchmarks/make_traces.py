"""Adversarial and agent-shaped replay traces, generated (no data files), in Mooncake format.

Each shape stresses a different eviction policy; the robust default must match the best fixed
policy on all of them (tests/test_adaptive.py, benchmarks/replay_bench.py):

- ``coding_agent``: long coding-agent sessions (a shared ~15K-token tools+system prefix, each
  request the whole history so far, 3-1,000 requests per session, 15K-150K tokens), a dozen
  sessions active at once. Finished sessions' deep history is hot while they run and dead after:
  recency wins, frequency squats.
- ``scan_hot``: a few returning conversations between one-off prompts just long enough to flush
  them from an LRU cache: frequency wins.
- ``loop``: the same prompts in a cycle a little larger than the cache: LRU gets nothing.
- ``zipf``: documents of Zipf popularity under one system prompt, each with a one-off question.
- ``shared_prefix``: many short sessions over one huge shared prefix.

    .venv/bin/python benchmarks/make_traces.py --shape coding_agent --out coding_agent.jsonl
    .venv/bin/python benchmarks/make_traces.py --all traces/   # every shape, default sizes

The chat shapes (``chat_bursts``, ``chat_agent``, ``diurnal``, ``scan_bursts``) are in
``chat_shapes.py``. ``--scale`` shrinks or grows the number of sessions/requests; ``--block`` is
the tokens per hash id (by default 64, 512 for the chat shapes: replay with ``--block-size B
--trace-block-tokens B``).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Callable
from pathlib import Path

from chat_shapes import CHAT_SHAPES
from trace_parts import History, Ids, Record, write


def coding_agent(
    seed: int = 0,
    scale: float = 1.0,
    block: int = 64,
    num_sessions: int = 120,
    concurrency: int = 50,
    token_scale: float = 1.0,
) -> list[Record]:
    """Long agent sessions over a shared prefix: Poisson arrivals, ~30 s between a session's
    requests, about ``concurrency`` sessions running at once. ``token_scale`` shrinks every
    length (tests: the same shape in a tenth of the tokens)."""
    rng, ids = random.Random(seed), Ids()
    think_s = 30.0
    max_turns = max(4.0, 1000 * scale)
    mean_turns = (max_turns - 3) / math.log(max_turns / 3)  # of a log-uniform 3..max_turns
    arrival_s = mean_turns * think_s / concurrency
    prefix = list(range(int(15_000 * token_scale) // block))  # tools + system prompt, shared
    events: list[tuple[float, int]] = []
    t = 0.0
    for k in range(num_sessions):
        t += rng.expovariate(1 / arrival_s)
        heapq.heappush(events, (t, k))
    state: dict[int, tuple[History, int, float]] = {}
    out: list[Record] = []
    while events:
        t, k = heapq.heappop(events)
        if k not in state:
            turns = max(3, int(math.exp(rng.uniform(math.log(3), math.log(max_turns)))))
            final = rng.uniform(20_000, 150_000) * token_scale
            h = History(prefix, len(prefix) * block, ids)
            h.extend(int(rng.randrange(500, 3000) * token_scale), block)  # the task
            state[k] = (h, turns, (final - h.num_tokens) / turns)
        h, left, grow = state[k]
        out.append(h.record(int(t * 1000), rng.randrange(50, 600)))
        h.extend(max(1, int(grow * rng.uniform(0.3, 1.7))), block)  # reply + tool result
        state[k] = (h, left - 1, grow)
        if left > 1:
            heapq.heappush(events, (t + rng.expovariate(1 / think_s), k))
    return out


def scan_hot(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """Hot conversations return every few requests; one-off scan prompts pass in between."""
    rng, ids = random.Random(seed), Ids()
    num_hot, hot_blocks, scan_blocks = 8, 24, 30
    hot = [[0, *ids.run(hot_blocks - 1)] for _ in range(num_hot)]
    out: list[Record] = []
    for i in range(round(3000 * scale)):
        is_hot = i % 3 == 0  # a new question on a returning document, else a one-off prompt
        chain = rng.choice(hot) + ids.run(1) if is_hot else [0, *ids.run(scan_blocks - 1)]
        out.append({"timestamp": i, "input_length": len(chain) * block - block // 2,
                    "output_length": 1, "hash_ids": chain})  # fmt: skip
    return out


def loop(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """``num_prompts`` prompts requested in the same order, round after round."""
    ids = Ids()
    num_prompts, prompt_blocks = 40, 20
    prompts = [[0, *ids.run(prompt_blocks - 1)] for _ in range(num_prompts)]
    out: list[Record] = []
    for i in range(round(2000 * scale)):
        chain = prompts[i % num_prompts]
        out.append({"timestamp": i, "input_length": len(chain) * block,
                    "output_length": 1, "hash_ids": chain})  # fmt: skip
    return out


def zipf(
    seed: int = 0, scale: float = 1.0, block: int = 64, skew: float = 1.0, num_docs: int = 400
) -> list[Record]:
    """Documents (8-40 blocks) of Zipf(skew) popularity after one system prompt, one-off tails."""
    rng, ids = random.Random(seed), Ids()
    system = list(range(16))
    docs = [[*system, *ids.run(rng.randrange(8, 40))] for _ in range(num_docs)]
    weights = [1 / (r + 1) ** skew for r in range(len(docs))]
    out: list[Record] = []
    for i in range(round(3000 * scale)):
        chain = rng.choices(docs, weights)[0] + ids.run(rng.randrange(1, 4))
        out.append({"timestamp": i, "input_length": len(chain) * block - 7,
                    "output_length": 1, "hash_ids": chain})  # fmt: skip
    return out


def shared_prefix(seed: int = 0, scale: float = 1.0, block: int = 64) -> list[Record]:
    """One huge shared prefix (200 blocks); short sessions of 2-6 turns, 30 at a time."""
    rng, ids = random.Random(seed), Ids()
    prefix = list(range(200))
    active: list[tuple[History, int]] = []
    out: list[Record] = []
    for i in range(round(4000 * scale)):
        if len(active) < 30:
            h = History(prefix, len(prefix) * block, ids)
            h.extend(rng.randrange(100, 800), block)
            active.append((h, rng.randrange(2, 7)))
        j = rng.randrange(len(active))
        h, left = active[j]
        out.append(h.record(i, 1))
        h.extend(rng.randrange(100, 1200), block)
        if left <= 1:
            active.pop(j)
        else:
            active[j] = (h, left - 1)
    return out


SHAPES: dict[str, Callable[..., list[Record]]] = {
    "coding_agent": coding_agent,
    "scan_hot": scan_hot,
    "loop": loop,
    "zipf": zipf,
    "shared_prefix": shared_prefix,
    **CHAT_SHAPES,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--out", help="the trace file (with --shape)")
    ap.add_argument("--all", metavar="DIR", help="write every shape as DIR/<shape>.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--block", type=int, help="tokens per hash id (default: the shape's own)")
    args = ap.parse_args()
    block = [] if args.block is None else [args.block]
    if args.all:
        Path(args.all).mkdir(parents=True, exist_ok=True)
        for name, gen in SHAPES.items():
            write(gen(args.seed, args.scale, *block), Path(args.all) / f"{name}.jsonl")
    elif args.shape and args.out:
        write(SHAPES[args.shape](args.seed, args.scale, *block), args.out)
    else:
        ap.error("give --shape and --out, or --all DIR")


if __name__ == "__main__":
    main()
