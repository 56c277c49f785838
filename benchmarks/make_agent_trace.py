"""A second replay trace, of another shape than Mooncake's: tau-bench agent conversations.

Each trajectory becomes a conversation: a new one arrives every ~6 s (Poisson), each turn follows
the previous reply after an exponential ~30 s think time, and each prompt is the whole history
so far (message characters / 4 as tokens; the shared system prompt is the same blocks in every
conversation). Written in Mooncake format (512-token hash ids, the growing last block renamed
each turn), for `promptcache replay` and `benchmarks/replay_bench.py`.

    .venv/bin/python benchmarks/make_agent_trace.py --tau DATA_DIR/tau_bench/gpt-4o-airline.json --out agent_trace.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from typing import Any

BLOCK = 512


class Ids:
    def __init__(self) -> None:
        self.next = 1

    def extend(self, ids: list[int], num_tokens: int, new_tokens: int) -> tuple[list[int], int]:
        """Chained ids after ``new_tokens`` more: full blocks keep their ids, the partial last
        block is renamed (its content changed)."""
        total = num_tokens + new_tokens
        ids = ids[: num_tokens // BLOCK]
        while len(ids) * BLOCK < total:
            ids.append(self.next)
            self.next += 1
        return ids, total


def tokens_of(message: dict[str, Any]) -> int:
    return max(1, len(str(message.get("content") or message.get("tool_calls") or "")) // 4)


def build(
    trajs: list[list[dict[str, Any]]], seed: int, arrival_s: float, think_s: float
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    ids_gen = Ids()
    events: list[tuple[float, int]] = []
    t = 0.0
    for k in range(len(trajs)):
        t += rng.expovariate(1 / arrival_s)
        heapq.heappush(events, (t, k))
    num_sys = tokens_of(trajs[0][0]) // BLOCK
    state: dict[int, tuple[list[int], int, int]] = {}
    out = []
    while events:
        t, k = heapq.heappop(events)
        traj = trajs[k]
        ids, num_tokens, pos = state.get(
            k, ([10**9 + i for i in range(num_sys)], num_sys * BLOCK, 1)
        )
        added = 0
        while pos < len(traj) and traj[pos]["role"] != "assistant":
            added += tokens_of(traj[pos])
            pos += 1
        if pos >= len(traj):
            continue
        ids, num_tokens = ids_gen.extend(ids, num_tokens, added)
        reply = tokens_of(traj[pos])
        out.append({"timestamp": int(t * 1000), "input_length": num_tokens, "output_length": reply,
                    "hash_ids": list(ids)})  # fmt: skip
        state[k] = (*ids_gen.extend(ids, num_tokens, reply), pos + 1)
        heapq.heappush(events, (t + rng.expovariate(1 / think_s), k))
    return sorted(out, key=lambda r: r["timestamp"])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tau", required=True, help="tau-bench trajectories (JSON)")
    p.add_argument("--out", required=True)
    p.add_argument("--repeat", type=int, default=3, help="use each trajectory this many times")
    p.add_argument("--arrival-s", type=float, default=6.0)
    p.add_argument("--think-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.tau) as f:
        trajs = [d["traj"] for d in json.load(f)] * args.repeat
    rows = build(trajs, args.seed, args.arrival_s, args.think_s)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(
        f"wrote {len(rows)} requests, {sum(r['input_length'] for r in rows):,} prompt tokens to {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
