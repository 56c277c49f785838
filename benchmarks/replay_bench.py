"""Hit rate vs capacity on every trace shape, for every eviction policy, the default and the
offline optimum; the default's worst shortfall against the best fixed policy is printed last.

Run: .venv/bin/python benchmarks/replay_bench.py            # every shape below that is available
     .venv/bin/python benchmarks/replay_bench.py --shapes loop zipf --json out.json
     .venv/bin/python benchmarks/replay_bench.py --shapes none --trace other.jsonl --block 512

Shapes: the generated ones of benchmarks/make_traces.py (block 64), three of them held out
(``*_held``: a seed, skew, number of system prompts and budgets the default was never tuned
on); the Mooncake conversation
trace (block 512, ``--mooncake``); tau-bench agent conversations made by
benchmarks/make_agent_trace.py (``--tau``; both default to ../shared/data beside the
checkout); an ``aiperf synthesize agentic-code``
dataset given with ``--aiperf FILE`` (multi-turn sessions, replies saved as the server does).
Belady is the next-use-optimal policy on the same tree (``policy_ceiling.HashFuture``).
The ``mini`` column is the candidate the default's sampled simulations ranked first; ``cpu vs
lru`` the default's replay CPU time over LRU's at that capacity (CPU time: on a shared machine
wall time mostly measures the neighbours), which should stay at or under 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chat_shapes import CHAT_SHAPES  # noqa: E402
from make_traces import SHAPES  # noqa: E402
from policy_ceiling import HashFuture, OraclePolicy  # noqa: E402

from promptcache.core.policy import DEFAULT_POLICY, policy_names  # noqa: E402
from promptcache.core.replay import ATTENTION_CONTEXT, TraceRequest, read_trace, replay  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
RULES = ("session", "recompute")  # the cache-aware rules: their fractions of the optimum too


class Shape(NamedTuple):
    name: str
    load: Callable[[], list[TraceRequest]]
    block: int  # cache block and trace block tokens
    capacities: tuple[int, ...]  # tokens
    with_output: bool = False


def generated(
    name: str, scale: float, seed: int = 0, **options: Any
) -> Callable[[], list[TraceRequest]]:
    def load() -> list[TraceRequest]:
        block = [] if name in CHAT_SHAPES else [64]
        return [
            TraceRequest(int(d["timestamp"]), d["input_length"], d["output_length"], d["hash_ids"])
            for d in SHAPES[name](seed, scale, *block, **options)
        ]

    return load


def mooncake_half(path: Path, half: str) -> Callable[[], list[TraceRequest]]:
    """The trace's first half by time (``a``: the half policies were tuned on) or its second
    (``b``: held out)."""

    def load() -> list[TraceRequest]:
        requests = list(read_trace(path))
        mid = requests[len(requests) // 2].timestamp
        return [r for r in requests if (r.timestamp < mid) == (half == "a")]

    return load


def tau_trace(path: Path) -> list[TraceRequest]:
    from make_agent_trace import build

    with open(path) as f:
        trajs = [d["traj"] for d in json.load(f)] * 3
    rows = build(trajs, 0, 6.0, 30.0)
    return [
        TraceRequest(r["timestamp"], r["input_length"], r["output_length"], r["hash_ids"])
        for r in rows
    ]


def shapes(args: argparse.Namespace) -> list[Shape]:
    k = 64  # tokens per block in the generated shapes
    out = [
        Shape("coding_agent", generated("coding_agent", 0.2), 64, (250_000, 500_000, 1_000_000, 2_000_000)),
        Shape("scan_hot", generated("scan_hot", 1.0), 64, (150 * k, 250 * k, 400 * k, 800 * k)),
        Shape("loop", generated("loop", 1.0), 64, (200 * k, 500 * k, 700 * k, 900 * k)),
        Shape("zipf", generated("zipf", 1.0), 64, (500 * k, 1000 * k, 2500 * k, 5000 * k)),
        Shape("shared_prefix", generated("shared_prefix", 1.0), 64, (300 * k, 600 * k, 1200 * k, 2400 * k)),
    ]  # fmt: skip
    chat = (1_000_000, 3_100_000, 10_000_000)  # the chat shapes are at the Mooncake block size
    out += [Shape(name, generated(name, 1.0), 512, chat) for name in CHAT_SHAPES]
    # held out: never tuned on (another seed, skew, number of system prompts, budgets)
    out += [
        Shape("zipf_0.8_held", generated("zipf", 1.5, 1, skew=0.8, num_docs=600), 64,
              (750 * k, 1500 * k, 3000 * k, 6000 * k)),
        Shape("chat_bursts_3sys_held", generated("chat_bursts", 1.0, 1, num_systems=3), 512,
              (700_000, 2_000_000, 6_000_000)),
        Shape("chat_bursts_16sys_held", generated("chat_bursts", 1.5, 2, num_systems=16), 512,
              (1_500_000, 4_500_000, 12_000_000)),
    ]  # fmt: skip
    mooncake = Path(args.mooncake)
    if mooncake.exists():
        out.append(Shape("mooncake", lambda: list(read_trace(mooncake)), 512,
                         (500_000, 1_000_000, 3_100_000, 10_000_000)))  # fmt: skip
        out.append(Shape("mooncake_a", mooncake_half(mooncake, "a"), 512, chat))
        out.append(Shape("mooncake_b", mooncake_half(mooncake, "b"), 512, chat))
    tau = Path(args.tau)
    if tau.exists():
        out.append(Shape("tau_agent", lambda: tau_trace(tau), 512,
                         (100_000, 250_000, 500_000, 1_000_000)))  # fmt: skip
    if args.trace:  # any other Mooncake-format trace, at the Mooncake capacities
        out.append(Shape(Path(args.trace).stem, lambda: list(read_trace(args.trace)), args.block,
                         (500_000, 1_000_000, 3_100_000, 10_000_000)))  # fmt: skip
    if args.aiperf:
        out.append(Shape("aiperf_agentic", lambda: list(read_trace(args.aiperf)), 512,
                         (500_000, 1_000_000, 2_000_000, 4_000_000), with_output=True))  # fmt: skip
    return [s for s in out if not args.shapes or s.name in args.shapes]


def print_compute(rows: list[dict[str, Any]], policies: list[str], context: int) -> None:
    """Compute saved: each hit weighted by the prefill it skips, a token at position p costing
    1 + p / C (``replay.prefill_cost``); Belady here is the hit-count optimum, a reference
    that a cost-aware rule can beat, not this metric's optimum."""
    print(f"\nCompute saved (a token at position p costs 1 + p/C to prefill, C = {context:,}):")
    head = " | ".join(policies)
    print(
        f"| trace | capacity | {head} | belady (hits) | best fixed | shortfall | default / belady |"
    )
    print("|---|---:|" + "---:|" * (len(policies) + 4))
    for row in rows:
        cs = row["compute_saved"]
        best = max((p for p in policies if p != DEFAULT_POLICY), key=cs.__getitem__)
        row["compute_best_fixed"] = best
        cells = [f"{cs[p]:.4f}" for p in policies]
        row["compute_shortfall"] = cs[best] - cs[DEFAULT_POLICY]
        of = cs[DEFAULT_POLICY] / cs["belady"] if cs.get("belady") else None
        cells += [f"{cs['belady']:.4f}" if "belady" in cs else "-", best,
                  f"{row['compute_shortfall']:+.4f}", f"{of:.3f}" if of else "-"]  # fmt: skip
        print(f"| {row['trace']} | {row['capacity_tokens']:,} | {' | '.join(cells)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="*", help="only these shapes")
    ap.add_argument("--aiperf", help="an `aiperf synthesize agentic-code` dataset.jsonl")
    ap.add_argument("--trace", help="another Mooncake-format trace (its own shape)")
    ap.add_argument("--block", type=int, default=512, help="block tokens for --trace")
    ap.add_argument("--mooncake", default=str(SHARED / "mooncake" / "conversation_trace.jsonl"),
                    help="the Mooncake conversation trace (whole, and each half by time)")  # fmt: skip
    ap.add_argument("--tau", default=str(SHARED / "tau_bench" / "gpt-4o-airline.json"),
                    help="tau-bench trajectories (the tau_agent shape)")  # fmt: skip
    ap.add_argument("--no-belady", action="store_true")
    ap.add_argument("--attention-context", type=int, default=ATTENTION_CONTEXT,
                    help="C of the compute-saved metric: a token at position p costs 1 + p/C")  # fmt: skip
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    fixed = [p for p in policy_names() if p != DEFAULT_POLICY]
    cols = [*fixed, f"{DEFAULT_POLICY} (default)", "belady", "best fixed", "shortfall", "mini"]
    cols.append("default / belady")
    rules = [r for r in RULES if r in fixed]
    cols += [f"{r} / belady" for r in rules]
    cols.append("cpu vs lru")
    print(f"| trace | capacity (tokens) | {' | '.join(cols)} |")
    print("|---|---:|" + "---:|" * len(cols))
    rows: list[dict[str, Any]] = []
    for shape in shapes(args):
        requests = shape.load()
        kw = dict(
            block_size=shape.block,
            trace_block_tokens=shape.block,
            with_output=shape.with_output,
            attention_context=args.attention_context,
        )
        future = (
            None
            if args.no_belady
            else HashFuture(requests, shape.block, shape.block, shape.with_output)
        )
        for cap in shape.capacities:
            row: dict[str, Any] = {
                "trace": shape.name, "capacity_tokens": cap, "seconds": {}, "cpu_seconds": {},
                "compute_saved": {},
            }  # fmt: skip
            for p in [*fixed, DEFAULT_POLICY]:
                cpu = time.process_time()
                r = replay(requests, cap, policy=p, **kw)
                row["cpu_seconds"][p] = time.process_time() - cpu
                row[p] = r["hit_rate"]
                row["compute_saved"][p] = r["compute_saved"]
                row["seconds"][p] = r["seconds"]
                if p == DEFAULT_POLICY:
                    row["mini"] = r.get("policy_leader", "-")
                    row["whatif"] = {k: v for k, v in r.items() if k.startswith("whatif")}
            if future is not None:
                r = replay(requests, cap, policy=OraclePolicy(future, "belady"),
                           before_request=future.set_current, **kw)  # fmt: skip
                row["belady"] = r["hit_rate"]
                row["compute_saved"]["belady"] = r["compute_saved"]
            best = max(fixed, key=lambda p: row[p])
            row["best_fixed"] = best
            row["shortfall"] = row[best] - row[DEFAULT_POLICY]
            rows.append(row)
            cells = [f"{row[p]:.4f}" for p in [*fixed, DEFAULT_POLICY]]
            cpu = row["cpu_seconds"]
            row["cpu_vs_lru"] = cpu[DEFAULT_POLICY] / cpu["lru"] if cpu.get("lru") else None
            cells += [f"{row['belady']:.4f}" if "belady" in row else "-", best,
                      f"{row['shortfall']:+.4f}", row["mini"],
                      f"{row['cpu_vs_lru']:.2f}" if row["cpu_vs_lru"] else "-"]  # fmt: skip
            if row.get("belady"):
                row["of_optimum"] = row[DEFAULT_POLICY] / row["belady"]
                row["of_optimum_by_policy"] = {
                    p: row[p] / row["belady"] for p in [*fixed, DEFAULT_POLICY]
                }
            cells.insert(-1, f"{row['of_optimum']:.3f}" if "of_optimum" in row else "-")
            for rule in rules:
                of = row.get("of_optimum_by_policy", {}).get(rule)
                cells.insert(-1, f"{of:.3f}" if of is not None else "-")
            print(f"| {shape.name} | {cap:,} | {' | '.join(cells)} |", flush=True)
    print_compute(rows, [*fixed, DEFAULT_POLICY], args.attention_context)
    print("\nReplay seconds (median over capacities) and speed relative to LRU:")
    print(f"| trace | {' | '.join(f'{p} s' for p in [*fixed, DEFAULT_POLICY])} | slowest vs lru |")
    print("|---|" + "---:|" * (len(fixed) + 2))
    for name in dict.fromkeys(r["trace"] for r in rows):
        med = {
            p: statistics.median(r["seconds"][p] for r in rows if r["trace"] == name)
            for p in [*fixed, DEFAULT_POLICY]
        }
        slowest = max(med.values()) / med["lru"] if "lru" in med else float("nan")
        print(f"| {name} | {' | '.join(f'{v:.1f}' for v in med.values())} | {1 / slowest:.2f}x |")
    timed = [r for r in rows if r.get("cpu_vs_lru")]
    if timed:
        slow = max(timed, key=lambda r: r["cpu_vs_lru"])
        print(
            f"\nslowest default vs lru (CPU time, per capacity): {slow['cpu_vs_lru']:.2f}x"
            f" ({slow['trace']} at {slow['capacity_tokens']:,} tokens)"
        )
    worst = max(rows, key=lambda r: r["shortfall"])
    print(
        f"\nworst shortfall of the default vs the best fixed policy: {worst['shortfall']:+.4f}"
        f" ({worst['trace']} at {worst['capacity_tokens']:,} tokens: {worst['best_fixed']}"
        f" {worst[worst['best_fixed']]:.4f}, default {worst[DEFAULT_POLICY]:.4f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
