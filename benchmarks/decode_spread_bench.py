"""Decode speed process by process: how much of the run-to-run spread is the process itself.

Each run is a fresh process that loads the bundled model on the torch engine (cache off, no
HTTP), prefills one ``--context``-token prompt and decodes ``--decode`` tokens twice; its two
rates (tokens after the first / their time) come back. Variants (``--variant NAME=ENV``, e.g.
``thp=THP_MEM_ALLOC_ENABLE=1``) alternate run by run with the plain one, so the machine's drift
falls on each alike. Prints every run, then per variant the median and the spread (max / min - 1)
of the second rates. Each run's line also names the weight layouts its process chose.

    .venv/bin/python benchmarks/decode_spread_bench.py --runs 10 --variant thp=THP_MEM_ALLOC_ENABLE=1

``--pair TURNS``: two processes loaded side by side reply in turns instead (A B A B ...), which
tells a process's own speed from a slow phase of the machine (that one moves both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load(context: int) -> tuple[Any, list[int]]:
    """In a child: the bundled model on the torch engine (cache off) and a seeded prompt."""
    import random

    from promptcache.engines.factory import build_engine

    rng = random.Random(7)
    ids = [rng.randrange(100, 40000) for _ in range(context)]
    return build_engine("torch", None, cache_enabled=False), ids


def reply_rate(engine: Any, ids: list[int], decode: int) -> float:
    """Tokens after the first / their time, for one greedy reply of ``decode`` tokens."""
    import time

    from promptcache.engines.base import Finished, SamplingParams, TextDelta

    first = None
    for ev in engine.generate(ids, SamplingParams(max_tokens=decode, ignore_eos=True)):
        if isinstance(ev, TextDelta) and first is None:
            first = time.perf_counter()
        elif isinstance(ev, Finished) and first is not None:
            return (ev.completion_tokens - 1) / (time.perf_counter() - first)
    raise RuntimeError("the reply ended before its second token")


def one_process(context: int, decode: int) -> dict[str, Any]:
    """Runs in the child: the two decode rates of one process, and the weight layouts it chose
    (``torch/layouts.py``: a near-tie can go either way from process to process)."""
    engine, ids = load(context)
    rates = [reply_rate(engine, ids, decode) for _ in range(2)]
    from promptcache.engines.torch.layout_memo import shape_name

    chosen = engine.runner.model.__dict__.get("promptcache_layouts", {})
    return {"rates": rates, "layouts": {shape_name(k): v for k, v in chosen.items()}}


def decode_in_turns(conn: Any, context: int, decode: int) -> None:
    """Runs in a child of ``--pair``: loads the engine, then one reply's rate per "go"."""
    engine, ids = load(context)
    conn.send("ready")
    while conn.recv() == "go":
        conn.send(reply_rate(engine, ids, decode))


def run_pair(turns: int, context: int, decode: int) -> None:
    """Two processes loaded side by side decode in turns (A B A B ...): a process of its own
    keeps its rate from turn to turn, while a slow phase of the machine moves both."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=decode_in_turns, args=(child, context, decode)))
        procs[-1].start()
        conns.append(parent)
    for conn in conns:
        conn.recv()
    for turn in range(turns):
        conns[turn % 2].send("go")
        print(f"turn {turn + 1} {'AB'[turn % 2]} {conns[turn % 2].recv():.1f} tok/s", flush=True)
    for conn, proc in zip(conns, procs, strict=True):
        conn.send("stop")
        proc.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=6, help="processes per variant")
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--variant", action="append", default=[], help="NAME=K=V[,K=V...]")
    p.add_argument("--pair", type=int, default=0, metavar="TURNS",
                   help="instead: two processes loaded side by side, TURNS replies in turns")  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.pair:
        run_pair(args.pair, args.context, args.decode)
        return 0
    if args.child:
        print(json.dumps(one_process(args.context, args.decode)))
        return 0
    variants: dict[str, dict[str, str]] = {"plain": {}}
    for spec in args.variant:
        name, _, pairs = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in pairs.split(",") if kv)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for run in range(args.runs):
        for name, env in variants.items() if run % 2 == 0 else list(variants.items())[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--context", str(args.context),
                 "--decode", str(args.decode)],
                env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True,
                text=True, check=True,
            )  # fmt: skip
            child = json.loads(out.stdout.strip().splitlines()[-1])
            got = child["rates"]
            rates[name].append(got[-1])
            shapes = " ".join(f"{k}:{v}" for k, v in sorted(child["layouts"].items()))
            print(f"run {run + 1} {name:<8} " + " / ".join(f"{r:.1f}" for r in got) + " tok/s  "
                  + shapes, flush=True)  # fmt: skip
    print("\n| variant | runs | decode tok/s, median | spread (max / min - 1) |")
    print("|---|---|---|---|")
    for name, got in rates.items():
        print(f"| {name} | {len(got)} | {statistics.median(got):.1f} | "
              f"{max(got) / min(got) - 1:.1%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
