"""peer_bench's tables: per-turn TTFT (cached tokens) [load] for every server, where
promptcache's TTFT went by phase, and paired after/before ratios against a baseline."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

Results = dict[str, list[list[dict[str, Any]]]]
PHASES = ("queued", "lookup", "restore", "prefill", "save", "first_token")


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def rows_of(results: Results, name: str, label: str) -> list[dict[str, Any]]:
    return [r for run in results[name] for r in run if r["turn"] == label]


def summarize(results: Results, args: argparse.Namespace) -> None:
    names = list(results)
    labels = [r["turn"] for r in results[names[0]][0] if r["turn"] != "decode"]
    runs = ", ".join(f"{n} {len(results[n])}" for n in names)
    print(f"\nmedians of the runs ({runs}); TTFT ms (cached tokens) [load average]\n")
    print("| turn | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in labels:
        cells = []
        for n in names:
            rows = rows_of(results, n, label)
            if not rows:
                cells.append("-")
                continue
            ttft, cached, load = med(rows, "ttft_s"), med(rows, "cached_tokens"), med(rows, "load")
            tag = rows[0]["tag"]
            cells.append(f"{ttft * 1e3:.0f} ({'n/a' if cached is None else int(cached)}) [{load:.1f}]"
                         + (f" {tag}" if tag else ""))  # fmt: skip
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for n in names:
        rows = [r for run in results[n] for r in run if r["turn"] == "decode"]
        rate, load = med(rows, "decode_tok_s"), med(rows, "load")
        cells.append(f"{rate:.1f} tok/s [{load:.1f}]" if rate else "-")
    if any(c != "-" for c in cells):
        print(f"| decode {args.decode} | " + " | ".join(cells) + " |")
    for n in names:
        phase_table(results, n, labels)
    if "promptcache-base" in results:
        for n in names:
            if n != "promptcache-base" and any("phases" in r for run in results[n] for r in run):
                ratio_table(results, n, "promptcache-base", labels)


def phase_table(results: Results, name: str, labels: list[str]) -> None:
    """Where a promptcache server's TTFT went, medians in ms: the client's TTFT, the part
    before the engine saw the request (HTTP, rendering, tokenizing, and the stream's first
    chunk back), then the engine's phases."""
    if not any(r.get("phases") for run in results[name] for r in run):
        return
    print(f"\n{name}: TTFT by phase, ms (medians)\n")
    cols = ("client", "http+render", *PHASES, "forwards")
    print("| turn | new tokens | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) + 1))
    for label in labels:
        rows = [r for r in rows_of(results, name, label) if r.get("phases")]
        if not rows:
            continue
        new = med([{"n": (r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0)} for r in rows], "n")
        outside = [{"v": r["ttft_s"] - r["engine_ttft_s"]} for r in rows if r.get("engine_ttft_s")]
        cells = [f"{(med(rows, 'ttft_s') or 0) * 1e3:.0f}", f"{(med(outside, 'v') or 0) * 1e3:.0f}"]
        for ph in PHASES:
            cells.append(f"{med([r['phases'] for r in rows], ph + '_ms') or 0:.0f}")
        cells.append(f"{med([r['phases'] for r in rows], 'num_forwards') or 0:.0f}")
        print(f"| {label} | {new:.0f} | " + " | ".join(cells) + " |")


def ratio_table(results: Results, name: str, base: str, labels: list[str]) -> None:
    """TTFT of ``name`` over ``base`` per turn: the median of the ratios of runs with the same
    index (run i of each ran back to back with --interleave: the same machine noise)."""
    pairs = list(zip(results[name], results[base], strict=False))
    print(f"\n{name} / {base}: TTFT ratio per turn, median of {len(pairs)} paired runs\n")
    print("| turn | ratio | runs |")
    print("|---|---:|---|")
    for label in labels:
        ratios = []
        for a, b in pairs:
            ra = [r for r in a if r["turn"] == label]
            rb = [r for r in b if r["turn"] == label]
            if ra and rb and rb[0]["ttft_s"]:
                ratios.append(ra[0]["ttft_s"] / rb[0]["ttft_s"])
        if ratios:
            each = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"| {label} | {statistics.median(ratios):.2f} | {each} |")
