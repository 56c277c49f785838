"""Hit rate vs capacity on a Mooncake-format trace, for every eviction policy.

Run: .venv/bin/python benchmarks/replay_bench.py --trace ../shared/data/mooncake/conversation_trace.jsonl
Prints a table (hit rate, replay seconds) and checks the LRU baseline against the published
figure (0.142 at 3.1 M tokens) when given the conversation trace.
"""

from __future__ import annotations

import argparse
import json

from promptcache.core.policy import policy_names
from promptcache.replay import read_trace, replay

CAPACITIES = (500_000, 1_000_000, 3_100_000, 10_000_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    requests = list(read_trace(args.trace))
    rows = []
    print("| policy | capacity (tokens) | hit rate | evicted blocks | replay s |")
    print("|---|---:|---:|---:|---:|")
    for policy in policy_names():
        for cap in CAPACITIES:
            r = replay(requests, cap, policy=policy)
            rows.append(r)
            print(
                f"| {policy} | {cap:,} | {r['hit_rate']:.4f} | {r['evicted_blocks']:,} | {r['seconds']:.1f} |",
                flush=True,
            )
    inf = replay(requests, 10**13, policy="lru")
    print(f"| (infinite) | - | {inf['hit_rate']:.4f} | 0 | {inf['seconds']:.1f} |")
    if "conversation_trace" in args.trace:
        lru = next(r for r in rows if r["policy"] == "lru" and r["capacity_tokens"] == 3_100_000)
        ok = abs(lru["hit_rate"] - 0.142) <= 0.02
        print(
            f"\nLRU at 3.1M: {lru['hit_rate']:.4f} vs published 0.142 -> {'within 0.02' if ok else 'OFF'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "infinite": inf}, f, indent=2)


if __name__ == "__main__":
    main()
