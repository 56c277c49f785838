"""Two checkouts, the same figures, measured interleaved: does a change regress any figure?

    git worktree add --detach BASE_DIR 8487e18
    PYTHONPATH=. .venv/bin/python benchmarks/compare_commits.py BASE_DIR . --pairs 5 \
        --figures core replay ssd bench batch --json compare.json

Every run is a fresh process whose ``PYTHONPATH`` starts with one checkout, so that checkout's
``promptcache`` is what is measured (checked: the imported file must lie inside it); the
benchmark code is this folder's (``core_bench``, ``ssd_bench``, ``batch_bench``,
``make_traces``), which uses only APIs both sides have. Pairs alternate their order (old new,
new old, ...) so a drift in the machine's load hits both sides alike. Per metric: the median of
each side, the median of the per-pair ratios new/old, the pairs where new is worse, and the
1-minute load average over the runs. Every run has ``OMP_NUM_THREADS=1``: torch's threads are
then the same on both sides whatever each commit's own ``--threads`` default is.

Figures:
- ``core``: core_bench lookup (from a list, from an array) and cold save at 1K/10K/100K tokens,
  metadata bytes per block (the default policy, and LRU on both sides), hashing via TokenSeq;
  CPU time (``core_bench.CLOCK``), as replay's CPU seconds: wall time there mostly measures the
  neighbours on a shared machine.
- ``replay``: generated traces (make_traces, block 64) through ``promptcache replay --json``
  (the CLI, default policy) and ``replay()`` for every policy: hit rates (must match) and CPU s.
- ``ssd``: ``ssd_bench.tier_write_read`` (the SSD tier alone: write MB/s, reload MB/s after a
  restart) and ``ssd_bench.ttft_row`` (bundled model: TTFT of a RAM hit, an SSD hit after a
  restart; the recompute is ``bench``'s cache-off TTFT).
- ``bench``: ``promptcache bench --turns T --repeats 1 --max-tokens 8``: TTFT with the cache on
  (turns 2+), off, and the live-KV ideal, on the bundled model.
- ``batch``: ``batch_bench`` against a real server of each side: qa (cache on, closed loop) and
  decode at each ``--sessions`` concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOWER, HIGHER, EXACT = "lower", "higher", "exact"  # which way is better; EXACT: must be equal
Metrics = dict[str, tuple[float, str]]
TRACES = (("loop", 0.5), ("shared_prefix", 0.25), ("scan_hot", 0.5))  # (make_traces shape, scale)
CAPACITIES = (16_000, 40_000)  # replay capacities, tokens


# -- figures (run in the child, against the checkout on its PYTHONPATH) --------------------------


def _cli_main() -> Any:
    """The ``promptcache`` command's ``main`` on either side of the cli package (issue 38)."""
    try:
        from promptcache.cli.main import main
    except ModuleNotFoundError:  # a checkout before it: one ``cli`` module
        from promptcache.cli import main  # type: ignore[attr-defined,no-redef]
    return main


def _replay_module() -> Any:
    """``core.replay``, or ``promptcache.replay`` on a checkout before issue 38."""
    import importlib

    try:
        return importlib.import_module("promptcache.core.replay")
    except ModuleNotFoundError:
        return importlib.import_module("promptcache.replay")


def figure_core(work: Path, args: argparse.Namespace) -> Metrics:
    import core_bench

    core_bench.CLOCK = time.process_time  # CPU time: the neighbours' load does not count
    out: Metrics = {}
    # the default policy, and lru: the same policy on both sides whatever each one's default is
    for policy in (None, "lru"):
        name = policy or "default policy"
        for row in core_bench.bench_lookup(policy=policy):
            n = row["prompt_tokens"]
            out[f"lookup ms {n} tok (list), {name}"] = (row["lookup_ms_from_list"], LOWER)
            out[f"lookup ms {n} tok (array), {name}"] = (row["lookup_ms_from_array"], LOWER)
            out[f"save ms cold {n} tok, {name}"] = (row["save_ms_cold"], LOWER)
        block = core_bench.bench_block_overhead(5000, policy=policy)
        out[f"bytes per block (metadata), {name}"] = (block["bytes_per_block"], LOWER)
    seq = core_bench.bench_hashing(num_tokens=200_000)[-1]  # the full path: TokenSeq(list)
    out["hash Mtok/s via TokenSeq"] = (seq["tokens_per_s"] / 1e6, HIGHER)
    out["sharing held/ideal"] = (core_bench.bench_sharing()["ratio"], EXACT)
    return out


def figure_replay(work: Path, args: argparse.Namespace) -> Metrics:
    from promptcache.core.policy import DEFAULT_POLICY, policy_names

    cli_main = _cli_main()
    replays = _replay_module()
    read_trace, replay = replays.read_trace, replays.replay

    out: Metrics = {}
    cpu: dict[str, float] = {}
    for name, _ in TRACES:
        path = work / f"{name}.jsonl"
        requests = list(read_trace(path))
        for cap in CAPACITIES:
            for policy in policy_names():
                t0 = time.process_time()
                r = replay(requests, cap, policy=policy, block_size=64, trace_block_tokens=64)
                cpu[policy] = cpu.get(policy, 0.0) + time.process_time() - t0
                out[f"hit {name} @{cap // 1000}K {policy}"] = (r["hit_rate"], EXACT)
            flags = ["--block-size", "64", "--trace-block-tokens", "64", "--json"]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                cli_main(["replay", str(path), "--capacity-tokens", str(cap), *flags])
            r = json.loads(buf.getvalue().strip().splitlines()[-1])
            out[f"hit {name} @{cap // 1000}K CLI ({DEFAULT_POLICY})"] = (r["hit_rate"], EXACT)
            out[f"CLI replay s {name} @{cap // 1000}K"] = (r["seconds"], LOWER)
    for policy, s in cpu.items():
        out[f"replay CPU s, all traces, {policy}"] = (s, LOWER)
    return out


def _model() -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from promptcache.models import resolve_model

    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok


def figure_ssd(work: Path, args: argparse.Namespace) -> Metrics:
    import ssd_bench
    import torch

    tier = ssd_bench.tier_write_read(work / "tier")
    out: Metrics = {
        "tier write MB/s": (tier["write_mb_s"], HIGHER),
        "tier reload MB/s (restart)": (tier["reload_mb_s"], HIGHER),
        "tier promoting lookup s": (tier["promote_lookup_s"], LOWER),
    }
    model, tok = _model()
    warm = ssd_bench.TorchEngine(model, tok, cache_enabled=False)
    ssd_bench.ttft(warm, list(range(100, 612)))  # first-forward costs, untimed
    n = args.ssd_tokens
    # no recompute: a plain prefill, the same code as `bench`'s cache-off TTFT (measured there)
    row = ssd_bench.ttft_row(model, tok, None, work / "cache", n, torch.Generator().manual_seed(0))
    out[f"TTFT s RAM hit {n}"] = (row["ram_hit_s"], LOWER)
    out[f"TTFT s SSD hit after restart {n}"] = (row["ssd_hit_s"], LOWER)
    out[f"engine SSD reload MB/s {n}"] = (row["reload_mb_s"], HIGHER)
    out[f"cached tokens, RAM hit {n}"] = (row["cached_ram"], EXACT)
    out[f"cached tokens, SSD hit {n}"] = (row["cached_ssd"], EXACT)
    return out


def figure_bench(work: Path, args: argparse.Namespace) -> Metrics:
    cli_main = _cli_main()

    folder = work / "bench"
    flags = ["--turns", str(args.turns), "--repeats", "1", "--max-tokens", "8"]
    assert cli_main(["bench", *flags, "--out", str(folder)]) == 0
    turns = json.loads((folder / "bench.json").read_text())["turns"]
    later = turns[1:]  # turn 1 has nothing cached but the warm-up
    return {
        "TTFT s on, turn 1": (turns[0]["ttft_on_s"], LOWER),
        "TTFT s on, turns 2+ (median)": (statistics.median(t["ttft_on_s"] for t in later), LOWER),
        "TTFT s off (median)": (statistics.median(t["ttft_off_s"] for t in turns), LOWER),
        "TTFT s ideal, turns 2+": (statistics.median(t["ttft_ideal_s"] for t in later), LOWER),
        "cached tokens, all turns": (sum(t["cached_tokens"] for t in turns), EXACT),
        # same-run ratios: the load drifts between runs far more than between a run's modes
        "on/ideal, turns 2+ (same run)": (
            statistics.median(t["on_vs_ideal"] for t in later),
            LOWER,
        ),
        "on/off, turns 2+ (same run)": (statistics.median(t["on_vs_off"] for t in later), LOWER),
    }


def figure_batch(work: Path, args: argparse.Namespace) -> Metrics:
    import batch_bench

    sessions = [str(s) for s in args.sessions]
    argv = ["--sessions", *sessions, "--scenarios", "qa", "decode", "--modes", "on",
            "--rounds", "2", "--max-tokens", "16", "--decode-tokens", "24", "--threads", "1",
            "--src", args.side, "--out", str(work / "batch"), "--label", "run"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        batch_bench.main(argv)
    res = json.loads((work / "batch" / "batch_bench_run.json").read_text())
    out: Metrics = {}
    for r in res["qa"]:
        s = r["sessions"]
        out[f"qa output tok/s, {s} sessions"] = (r["output_tok_s"], HIGHER)
        out[f"qa TTFT p50 s, {s} sessions"] = (r["ttft_p50"], LOWER)
    for r in res["decode"]:
        out[f"decode tok/s, {r['streams']} streams"] = (r["decode_tok_s"], HIGHER)
    return out


FIGURES = {"core": figure_core, "replay": figure_replay, "ssd": figure_ssd,
           "bench": figure_bench, "batch": figure_batch}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    """One figure against the checkout ``args.side``; prints ``RESULT {json}`` last."""
    import promptcache

    where = Path(promptcache.__file__).resolve()
    if Path(args.side).resolve() not in where.parents:
        raise SystemExit(f"imported {where}, not from {args.side}: check PYTHONPATH")
    sys.path.insert(1, str(HERE))
    work = Path(args.work)
    metrics = FIGURES[args.child](work, args)
    print("RESULT " + json.dumps({"file": str(where), "metrics": metrics}), flush=True)


# -- the parent: interleaved runs, the table -----------------------------------------------------


def run_side(figure: str, side: Path, work: Path, args: argparse.Namespace, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(side), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", figure, "--side", str(side),
           "--work", str(work), "--turns", str(args.turns), "--ssd-tokens", str(args.ssd_tokens),
           "--sessions", *map(str, args.sessions)]  # fmt: skip
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.run(
            cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=f, timeout=1800
        )
    f_out = proc.stdout.decode()
    with open(log, "a") as f:
        f.write(f_out)
    lines = [x for x in f_out.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{figure} on {side} failed ({proc.returncode}); see {log}")
    return {**json.loads(lines[-1][7:]), "load": load, "wall_s": time.perf_counter() - t0}


def make_traces(work: Path) -> None:
    sys.path.insert(0, str(HERE))
    from make_traces import SHAPES, write

    for name, scale in TRACES:
        write(SHAPES[name](0, scale, 64), work / f"{name}.jsonl")


def table(figure: str, runs: list[tuple[dict, dict]]) -> list[dict[str, Any]]:
    rows = []
    load = [r["load"] for pair in runs for r in pair]
    for name, (_, better) in runs[0][0]["metrics"].items():
        pairs = [(o["metrics"][name][0], n["metrics"][name][0]) for o, n in runs
                 if name in o["metrics"] and name in n["metrics"]]  # fmt: skip
        if not pairs:
            continue
        old, new = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        ratios = [n / o if o else (1.0 if n == o else float("inf")) for o, n in pairs]
        worse = sum((n > o) if better == LOWER else (n < o) if better == HIGHER else (n != o)
                    for o, n in pairs)  # fmt: skip
        rows.append({"figure": figure, "metric": name, "better": better, "old": old, "new": new,
                     "ratio": statistics.median(ratios), "ratios": ratios, "worse": worse,
                     "pairs": len(pairs), "load": [min(load), max(load)]})  # fmt: skip
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("| figure | metric | better | old median | new median | ratio new/old (median) | "
          "pairs new worse | n pairs | load 1-min |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['figure']} | {r['metric']} | {r['better']} | {r['old']:.4g} | "
              f"{r['new']:.4g} | {r['ratio']:.3f} | {r['worse']} | {r['pairs']} | "
              f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("old", nargs="?", help="the baseline checkout (a folder)")
    ap.add_argument("new", nargs="?", help="the checkout to compare (a folder)")
    ap.add_argument("--figures", nargs="+", default=list(FIGURES), choices=list(FIGURES))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3, help="bench: turns")
    ap.add_argument("--ssd-tokens", type=int, default=1024, help="ssd: history tokens")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4], help="batch: concurrencies")
    ap.add_argument(
        "--wait-quiet", default=None, help="wait while this file exists (a reservation)"
    )
    ap.add_argument("--json", help="also write every run and the table here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not (args.old and args.new):
        ap.error("give the old and the new checkout")
    sides = (Path(args.old).resolve(), Path(args.new).resolve())
    work = Path(tempfile.mkdtemp(prefix="pc-compare-"))
    make_traces(work)
    result: dict[str, Any] = {"old": str(sides[0]), "new": str(sides[1]), "runs": {}, "rows": []}
    for key, side in zip(("old", "new"), sides, strict=True):
        head = subprocess.run(["git", "-C", str(side), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(side), "status", "--porcelain", "promptcache"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        result[f"{key}_commit"] = head + (" (promptcache/ modified)" if dirty else "")
        print(f"{key}: {side} at {result[f'{key}_commit']}", flush=True)
    for figure in args.figures:
        runs: list[tuple[dict, dict]] = []
        for i in range(args.pairs):
            while args.wait_quiet and os.path.exists(args.wait_quiet):
                time.sleep(10)
            got = {}
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                got[k] = run_side(figure, sides[k], work, args, work / f"{figure}.log")
                print(f"{figure} pair {i + 1} {'old' if k == 0 else 'new'}: "
                      f"{got[k]['wall_s']:.0f} s, load {got[k]['load']:.1f}", flush=True)  # fmt: skip
            runs.append((got[0], got[1]))
        result["runs"][figure] = runs
        rows = table(figure, runs)
        result["rows"] += rows
        print_rows(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    print()
    print_rows(result["rows"])


if __name__ == "__main__":
    main()
