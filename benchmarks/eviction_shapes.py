"""The eviction default against the best fixed policy and the offline optimum, shape x budget.

Run: .venv/bin/python benchmarks/eviction_shapes.py                 # every generated shape
     .venv/bin/python benchmarks/eviction_shapes.py --mooncake DATA_DIR/mooncake/conversation_trace.jsonl
     .venv/bin/python benchmarks/eviction_shapes.py --shapes phase_change loop --no-belady

One row per shape and budget: the default's hit rate, the best fixed policy's (and its name), the
default's shortfall, and Belady's next-use optimum on the same tree (``policy_ceiling``). The
shapes: Mooncake-like chat at three seeds, skews and block sizes (``fool_shapes.mooncake_like``),
the chat shapes of ``chat_shapes.py``, coding-agent sessions, synthetic mixes (``make_traces``)
and the shapes built to fool the race (``fool_shapes``: a phase change, a scan wave, a working
set just above the cache). ``--mooncake`` adds a real Mooncake-format trace at 1M, 3.1M and 10M
tokens (block 512), held out: nothing here was tuned on it. The last line is the worst shortfall.

The default's result on one trace depends on which blocks its miniatures sample, and that
follows the block hashes, which cover the cache's namespace: ``--samples N`` replays it under N
namespaces and reports the mean (and the worst sample). One sample can be .005 off the mean
(scan_bursts at 10M: .5091-.5147 over five).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fool_shapes import FOOL_SHAPES  # noqa: E402
from make_traces import SHAPES  # noqa: E402
from policy_ceiling import HashFuture, OraclePolicy  # noqa: E402

from promptcache.core.policies import DEFAULT_POLICY, policy_names  # noqa: E402
from promptcache.core.policies.adaptive import CANDIDATES, AdaptivePolicy  # noqa: E402
from promptcache.core.replay import TraceRequest, read_trace, replay  # noqa: E402

ALL_SHAPES = {**SHAPES, **FOOL_SHAPES}
CHAT = (1_000_000, 3_100_000, 10_000_000)  # tokens, at block 512 (the budgets)


class Shape(NamedTuple):
    name: str
    load: Callable[[], list[TraceRequest]]
    block: int
    capacities: tuple[int, ...]  # tokens


def generated(name: str, seed: int, scale: float, block: int, **kw: Any) -> Callable[[], list]:
    def load() -> list[TraceRequest]:
        return [
            TraceRequest(int(d["timestamp"]), d["input_length"], d["output_length"], d["hash_ids"])
            for d in ALL_SHAPES[name](seed, scale, block, **kw)
        ]

    return load


def blocks(block: int, *n: int) -> tuple[int, ...]:
    return tuple(k * block for k in n)


def shapes(args: argparse.Namespace) -> list[Shape]:
    g = generated
    out = [
        # chat-like: few long shared prefixes, heavy one-shot traffic
        Shape("mooncake_like", g("mooncake_like", 1, 1.0, 512), 512, CHAT),
        Shape("mooncake_like_8sys", g("mooncake_like", 2, 1.0, 512, num_systems=8, skew=0.6,
              system_tokens=6_000, one_shot=0.7, first_tokens=3_000), 512, CHAT),
        Shape("mooncake_like_b256", g("mooncake_like", 3, 1.0, 256, one_shot=0.75,
              mean_turns=5.0, think_s=20.0), 256, CHAT),
        Shape("mooncake_like_slow", g("mooncake_like", 4, 1.0, 512, num_systems=2, skew=1.5,
              system_tokens=3_000, one_shot=0.5, think_s=300.0, first_tokens=8_000), 512, CHAT),
        Shape("chat_bursts", g("chat_bursts", 1, 1.0, 512), 512, CHAT),
        Shape("scan_bursts", g("scan_bursts", 2, 1.0, 512), 512, CHAT),
        Shape("diurnal", g("diurnal", 3, 1.0, 512), 512, CHAT),
        # agent sessions
        Shape("chat_agent", g("chat_agent", 1, 0.5, 512), 512, CHAT),
        Shape("coding_agent", g("coding_agent", 1, 0.2, 64), 64, blocks(64, 4000, 8000, 16000)),
        # synthetic mixes
        Shape("zipf_0.8", g("zipf", 1, 1.5, 64, skew=0.8, num_docs=600), 64,
              blocks(64, 750, 1500, 3000, 6000)),
        Shape("shared_prefix", g("shared_prefix", 1, 1.0, 64), 64, blocks(64, 300, 600, 1200)),
        # built to fool the race
        Shape("phase_change", g("phase_change", 1, 1.0, 64), 64, blocks(64, 150, 300, 600)),
        Shape("scan_wave", g("scan_wave", 1, 1.0, 64), 64, blocks(64, 150, 300, 600)),
        Shape("scan_hot", g("scan_hot", 1, 1.0, 64), 64, blocks(64, 150, 250, 400)),
        Shape("above_capacity", g("above_capacity", 1, 1.0, 64), 64, blocks(64, 400, 550, 700)),
        Shape("loop", g("loop", 1, 1.0, 64), 64, blocks(64, 500, 700, 900)),
    ]  # fmt: skip
    if args.mooncake:
        path = Path(args.mooncake)
        out.append(Shape("mooncake (held out)", lambda: list(read_trace(path)), 512, CHAT))
    return [s for s in out if not args.shapes or s.name in args.shapes]


def measure(
    shape: Shape, belady: bool, num_samples: int = 1, candidates: tuple[str, ...] = CANDIDATES
) -> list[dict[str, Any]]:
    """Per budget: every fixed policy's hit rate, the default's (the mean over ``num_samples``
    cache namespaces, each sampling other blocks into the what-if miniatures; its race among
    ``candidates``), and Belady's."""
    requests = shape.load()
    kw = dict(block_size=shape.block, trace_block_tokens=shape.block)
    future = HashFuture(requests, shape.block, shape.block) if belady else None
    fixed = [p for p in policy_names() if p != DEFAULT_POLICY]
    rows = []
    for cap in shape.capacities:
        row: dict[str, Any] = {"shape": shape.name, "capacity_tokens": cap}
        row["fixed"] = {p: replay(requests, cap, policy=p, **kw)["hit_rate"] for p in fixed}
        names = ["replay"] + [f"replay-{i}" for i in range(1, num_samples)]
        runs = [
            replay(requests, cap, policy=AdaptivePolicy(candidates), name=n, **kw) for n in names
        ]
        row["samples"] = [r["hit_rate"] for r in runs]
        row["default"] = sum(row["samples"]) / len(runs)
        row["leader"] = runs[0].get("policy_leader", "-")
        row["switches"] = runs[0].get("num_policy_switches", 0)
        row["best_fixed"] = max(fixed, key=row["fixed"].__getitem__)
        row["shortfall"] = row["fixed"][row["best_fixed"]] - row["default"]
        row["worst_sample_shortfall"] = row["fixed"][row["best_fixed"]] - min(row["samples"])
        if future is not None:
            oracle = OraclePolicy(future, "belady")
            r = replay(requests, cap, policy=oracle, before_request=future.set_current, **kw)
            row["belady"] = r["hit_rate"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="*", help="only these shapes")
    ap.add_argument("--mooncake", help="a Mooncake-format trace (block 512), held out")
    ap.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    ap.add_argument("--detail", action="store_true", help="also print every fixed policy")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument(
        "--samples",
        type=int,
        default=1,
        help="replay the default under this many cache namespaces (each samples other blocks"
        " into the what-if miniatures): its mean, and the worst sample's shortfall",
    )
    ap.add_argument(
        "--candidates",
        default=",".join(CANDIDATES),
        help="the default's race candidates, comma-separated (to measure another race)",
    )
    args = ap.parse_args()
    candidates = tuple(args.candidates.split(","))
    many = args.samples > 1
    print(
        "| shape | budget (tokens) | default | best fixed | shortfall |"
        + (" worst sample |" if many else "")
        + " belady | leader |"
    )
    print("|---|---:|---:|---|---:|" + ("---:|" if many else "") + "---:|---|")
    rows: list[dict[str, Any]] = []
    for shape in shapes(args):
        for row in measure(shape, not args.no_belady, args.samples, candidates):
            rows.append(row)
            best = row["best_fixed"]
            opt = f"{row['belady']:.4f}" if "belady" in row else "-"
            worst_sample = f" {row['worst_sample_shortfall']:+.4f} |" if many else ""
            print(
                f"| {row['shape']} | {row['capacity_tokens']:,} | {row['default']:.4f} |"
                f" {row['fixed'][best]:.4f} ({best}) | {row['shortfall']:+.4f} |{worst_sample}"
                f" {opt} | {row['leader']} ({row['switches']} sw) |",
                flush=True,
            )
            if args.detail:
                print("    " + " ".join(f"{p}={v:.4f}" for p, v in row["fixed"].items()))
    worst = max(rows, key=lambda r: r["shortfall"])
    print(
        f"\nworst shortfall: {worst['shortfall']:+.4f} ({worst['shape']} at"
        f" {worst['capacity_tokens']:,} tokens, best fixed {worst['best_fixed']})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
