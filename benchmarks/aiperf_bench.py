"""`aiperf profile` (NVIDIA's load generator, PyPI ``aiperf``, run from its own venv) against a
real `promptcache serve` on the bundled model: multi-turn sessions over a shared system prompt,
each with its own context and history, streaming, at several concurrencies, cache on vs off.

For every (cache, concurrency) cell it starts aiperf with the same synthetic dataset (fixed
``--random-seed``), reads ``profile_export_aiperf.json`` from the cell's artifact folder and
prints one table row: output tokens/s, TTFT p50/p95, request latency p50, requests. Cache on and
off are two servers, run one after the other; each cell is repeated ``--repeats`` times
(medians reported, every run kept in ``aiperf_bench.json``).

    PYTHONPATH=. .venv/bin/python benchmarks/aiperf_bench.py --aiperf AIPERF_VENV/bin/aiperf \\
        --concurrency 1 4 8 16 --out OUT_DIR
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

from promptcache.models import resolve_model
from promptcache.server.launcher import ServerProcess


def aiperf_args(args: argparse.Namespace, url: str, concurrency: int, out: Path) -> list[str]:
    """One cell's command line (printed, so it can be rerun by hand)."""
    num_sessions = max(concurrency, 2)  # one multi-turn session per concurrency slot
    return [
        args.aiperf, "profile",
        "--model", "default",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(resolve_model(None)),
        "--shared-system-prompt-length", str(args.system_tokens),
        "--user-context-prompt-length", str(args.context_tokens),
        "--num-dataset-entries", str(num_sessions),
        "--conversation-num", str(num_sessions),
        "--conversation-turn-mean", str(args.turns),
        "--conversation-turn-stddev", "0",
        "--synthetic-input-tokens-mean", str(args.isl),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.osl),
        "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", "temperature:0",
        "--concurrency", str(concurrency),
        "--request-count", str(num_sessions * args.turns),
        "--random-seed", "7",
        "--request-timeout-seconds", "1800",
        "--ui-type", "none",
        "--workers-max", str(min(concurrency, 4)),  # aiperf's own processes share the cores
        "--record-processors", "1",
        "--output-artifact-dir", str(out),
    ]  # fmt: skip


def read_cell(folder: Path) -> dict[str, float]:
    found = sorted(folder.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"no profile_export_aiperf.json under {folder}")
    data = json.loads(found[-1].read_text())
    records = data.get("records", data)

    def stat(name: str, key: str) -> float:
        rec = records.get(name) or {}
        return float(rec.get(key, float("nan")))

    return {
        "output_tok_s": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p95_ms": stat("time_to_first_token", "p95"),
        "latency_p50_ms": stat("request_latency", "p50"),
        "requests": stat("request_count", "avg"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable (its own venv)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--modes", nargs="+", default=["on", "off"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--context-tokens", type=int, default=100)
    ap.add_argument("--isl", type=int, default=40, help="new user tokens per turn")
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: not set)")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default="aiperf_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        extra = ["--no-ssd", "--max-queue", "64", *args.server_args.split()]
        srv = ServerProcess(
            extra + (["--no-cache"] if mode == "off" else []), log=out / "server.log"
        )
        if args.threads:
            srv.env["OMP_NUM_THREADS"] = str(args.threads)
        srv.start()
        try:
            for rep in range(args.repeats):
                for c in args.concurrency:
                    cell = out / f"{mode}-c{c}-r{rep}"
                    cmd = aiperf_args(args, srv.url, c, cell)
                    print("$", " ".join(cmd), flush=True)
                    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                    log = (cell.with_suffix(".log")).open("w")
                    subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
                    rows.append({"cache": mode, "concurrency": c, "repeat": rep, **read_cell(cell)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            srv.stop()
    (out / "aiperf_bench.json").write_text(json.dumps(rows, indent=2))
    print(
        "\n| cache | concurrency | output tok/s | TTFT p50 s | TTFT p95 s | latency p50 s | runs |"
    )
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["cache"], row["concurrency"]), []).append(row)
    for (mode, c), rs in groups.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith(("_s", "_ms"))}
        print(
            f"| {mode} | {c} | {med['output_tok_s']:.1f} | {med['ttft_p50_ms'] / 1000:.2f} | "
            f"{med['ttft_p95_ms'] / 1000:.2f} | {med['latency_p50_ms'] / 1000:.2f} | {len(rs)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
