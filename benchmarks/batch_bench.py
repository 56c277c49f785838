"""Concurrent serving benchmark: a real `promptcache serve` on the bundled default model
(SmolLM2-135M), many clients at once, cache on vs off.

Scenarios:

- ``qa``: the LMCache multi-round QA shape. S sessions share one system prompt; each has its
  own history (its questions and the model's replies) and sends ``--rounds`` turns: closed loop
  (``--qps 0``: every session starts at once and sends its next turn when the last reply ends:
  the worst case, bursts of S arrivals) or at a fixed request rate (``--qps Q``: request
  ``r*S+s`` is due at ``(r*S+s)/Q`` s, or when its history is ready). Every run asks fresh
  questions (only the system prompt and each session's own history can hit). Output tokens/s
  (all completion tokens / wall time), TTFT p50/p95 over every turn.
- ``decode``: S concurrent requests with short prompts, ``--decode-tokens`` each: aggregate
  decode tokens/s over the whole span (tokens after the first / time from the first first-token
  to the last token) and while all S decode (the chunks that arrived between the last first
  token and the first stream's last chunk).
- ``long``: one ~8K-token prompt starts prefilling; ``--probe-delay`` s later a short request
  arrives: its TTFT (the time it is stuck behind the long prompt) and the long one's.

TTFT = seconds from sending the request to the first SSE chunk with content (streaming).
Writes ``batch_bench_<label>.json`` to ``--out`` and prints a table of medians over
``--repeats``. Targets checked at the end: decode tokens/s with 8 streams >= 3x one stream; the
short request's TTFT during an 8K prefill <= 2 s; qa p95 TTFT with 8 sessions <= 3x the
1-session p50 (per ``--qps``).

    PYTHONPATH=. .venv/bin/python benchmarks/batch_bench.py --sessions 1 4 8 16 --qps 0 1 \
        --repeats 2 --out OUT_DIR
    # before/after: --src a folder holding another checkout's promptcache package
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agent_bench import ServerProcess  # the same folder: a real server on a free port

SYSTEM = (
    "You are a helpful assistant for a travel company. You answer questions about flights, "
    "bookings, baggage, refunds and loyalty points. Be concise and precise. "
) * 12  # ~400 tokens shared by every session
TOPICS = ["baggage", "refunds", "seat upgrades", "pets", "delays", "loyalty points", "visas",
          "meals", "wifi", "lounges", "car rental", "hotels", "insurance", "children",
          "sports gear", "cancellations"]  # fmt: skip


async def chat(client: Any, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    text, usage, stamps = [], {}, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
                    text.append(delta)
    end = time.perf_counter()
    first = first or end
    return {
        "ttft": first - t0,
        "t_first": first,
        "t_end": end,
        "completion_tokens": usage.get("completion_tokens", 0),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "text": "".join(text),
        "stamps": stamps,  # arrival of every chunk with content (one per token, nearly always)
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def qa(url: str, sessions: int, rounds: int, max_tokens: int, qps: float = 0.0) -> dict:
    import httpx

    t_start = time.perf_counter()
    run = f"{time.time_ns() % 10**9:09d}"  # fresh questions: no turn is cached by an earlier run

    async def session(client: Any, s: int) -> list[dict]:
        history = [{"role": "system", "content": SYSTEM}]
        out = []
        for r in range(rounds):
            if qps > 0:  # fixed rate: request r*S+s is due then (or when its history is ready)
                due = t_start + (r * sessions + s) / qps
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            topic = TOPICS[(s + r) % len(TOPICS)]
            history.append(
                {"role": "user", "content": f"Customer {s}-{run}, question {r}: {topic}?"}
            )
            rec = await chat(client, url, history, max_tokens)
            history.append({"role": "assistant", "content": rec["text"]})
            out.append(rec)
        return out

    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        recs = [x for xs in await asyncio.gather(*(session(client, s) for s in range(sessions)))
                for x in xs]  # fmt: skip
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in recs]
    return {
        "sessions": sessions,
        "qps": qps,
        "requests": len(recs),
        "output_tok_s": sum(r["completion_tokens"] for r in recs) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": pct(ttfts, 0.95),
        "cached_ratio": sum(r["cached_tokens"] for r in recs)
        / max(1, sum(r["prompt_tokens"] for r in recs)),
        "wall_s": wall,
    }


async def decode(url: str, streams: int, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=3600) as client:
        msgs = [
            [{"role": "user", "content": f"Write a long story about {TOPICS[i % 16]} number {i}."}]
            for i in range(streams)
        ]
        recs = await asyncio.gather(*(chat(client, url, m, max_tokens) for m in msgs))
    tokens = sum(max(0, r["completion_tokens"] - 1) for r in recs)
    span = max(r["t_end"] for r in recs) - min(r["t_first"] for r in recs)
    # while every stream decodes: from the last first token to the first stream's last chunk
    # (the span above also holds the steps where some prompts still prefill or some are done)
    lo, hi = max(r["t_first"] for r in recs), min(r["stamps"][-1] for r in recs)
    inside = sum(lo < t <= hi for r in recs for t in r["stamps"])
    return {
        "streams": streams,
        "decode_tok_s": tokens / span,
        "tokens": tokens,
        "all_decoding_tok_s": inside / (hi - lo) if hi > lo else float("nan"),
    }


async def long_prompt(url: str, long_tokens: int, delay: float) -> dict:
    import httpx

    filler = "hello world " * (long_tokens // 2)  # ~2 tokens per repeat (SmolLM2's tokenizer)
    async with httpx.AsyncClient(timeout=3600) as client:
        long_task = asyncio.create_task(
            chat(client, url, [{"role": "user", "content": filler + " Summarize."}], 1)
        )
        await asyncio.sleep(delay)
        short = await chat(client, url, [{"role": "user", "content": "Hi! How are you?"}], 8)
        long = await long_task
    return {
        "long_prompt_tokens": long["prompt_tokens"],
        "long_ttft": long["ttft"],
        "short_ttft": short["ttft"],
        "short_done_before_long": short["t_end"] < long["t_first"],
    }


def server(src: str | None, extra: list[str], log: Path, threads: int) -> ServerProcess:
    proc = ServerProcess(["--no-ssd", "--max-queue", "64", *extra], log=log)
    if src:
        proc.env["PYTHONPATH"] = src
    if threads:
        proc.env["OMP_NUM_THREADS"] = str(threads)
    return proc.start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--qps",
        type=float,
        nargs="+",
        default=[0.0],
        help="qa request rates (all sessions together, LMCache's --qps; a turn also waits for "
        "its history); 0: closed loop, every session starting at once",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of every row; medians reported")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--probe-delay", type=float, default=3.0)
    ap.add_argument("--scenarios", nargs="+", default=["qa", "decode", "long"])
    ap.add_argument("--modes", nargs="+", default=["on", "off"], help="cache on / off for qa")
    ap.add_argument("--src", default=None, help="PYTHONPATH for the server (another checkout)")
    ap.add_argument("--server-args", default="", help="extra `promptcache serve` flags")
    ap.add_argument("--label", default="after")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for the server (0: not set: the server picks, see `--threads`)",
    )
    ap.add_argument("--out", default="batch_bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = args.server_args.split()
    results: dict[str, Any] = {
        "label": args.label,
        "src": args.src or os.getcwd(),
        "threads": args.threads,
        "argv": sys.argv[1:],
    }
    for mode in args.modes if "qa" in args.scenarios else []:
        srv = server(
            args.src,
            extra + (["--no-cache"] if mode == "off" else []),
            out / "server.log",
            args.threads,
        )
        try:
            asyncio.run(qa(srv.url, 1, 1, 4))  # warm-up (first forward, the system prompt)
            for rep in range(args.repeats):
                for qps in args.qps:
                    for s in args.sessions:
                        row = asyncio.run(qa(srv.url, s, args.rounds, args.max_tokens, qps))
                        results.setdefault("qa", []).append({"cache": mode, "repeat": rep, **row})
                        print(json.dumps(results["qa"][-1]), flush=True)
        finally:
            srv.stop()
    if {"decode", "long"} & set(args.scenarios):
        srv = server(args.src, extra, out / "server.log", args.threads)
        try:
            asyncio.run(decode(srv.url, 1, 4))  # warm-up
            for rep in range(args.repeats if "decode" in args.scenarios else 0):
                for s in args.sessions:
                    row = asyncio.run(decode(srv.url, s, args.decode_tokens))
                    results.setdefault("decode", []).append({"repeat": rep, **row})
                    print(json.dumps(results["decode"][-1]), flush=True)
            for _ in range(args.repeats if "long" in args.scenarios else 0):
                row = asyncio.run(long_prompt(srv.url, args.long_tokens, args.probe_delay))
                results.setdefault("long", []).append(row)
                print(json.dumps(row), flush=True)
        finally:
            srv.stop()
    (out / f"batch_bench_{args.label}.json").write_text(json.dumps(results, indent=2))
    report(results)
    return 0


def medians(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict[str, float]]:
    """The median of every numeric field over the rows sharing ``keys``, in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return {
        key: {
            f: statistics.median(r[f] for r in rs)
            for f, v in rs[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        | {"n": len(rs)}
        for key, rs in groups.items()
    }


def report(r: dict[str, Any]) -> None:
    print(f"\n## {r['label']} (medians of repeats)")
    print("| cache | qps | sessions | output tok/s | TTFT p50 s | TTFT p95 s | cached | runs |")
    print("|---|---|---|---|---|---|---|---|")
    qa_rows = medians(r.get("qa", []), ("cache", "qps", "sessions"))
    for (cache, qps, sessions), m in qa_rows.items():
        print(
            f"| {cache} | {qps or 'closed'} | {sessions} | {m['output_tok_s']:.1f} | "
            f"{m['ttft_p50']:.2f} | {m['ttft_p95']:.2f} | {m['cached_ratio']:.0%} | {m['n']} |"
        )
    dm = {k[0]: m for k, m in medians(r.get("decode", []), ("streams",)).items()}
    dec = {n: m["decode_tok_s"] for n, m in dm.items()}
    both = {n: m["all_decoding_tok_s"] for n, m in dm.items()}
    if dec:
        print("\n| streams | decode tok/s (whole span) | x one | while all decode | x one | runs |")
        print("|---|---|---|---|---|---|")
        for n, v in dec.items():
            print(
                f"| {n} | {v:.1f} | {v / dec.get(1, v):.2f} | {both[n]:.1f} | "
                f"{both[n] / both.get(1, both[n]):.2f} | {dm[n]['n']} |"
            )
    if 1 in dec and 8 in dec:
        print(
            f"target decode x8 >= 3x one: {dec[8] / dec[1]:.2f}x over the whole span, "
            f"{both[8] / both[1]:.2f}x while all 8 decode"
        )
    if r.get("long"):
        shorts = [x["short_ttft"] for x in r["long"]]
        print(
            f"target short TTFT during a {r['long'][0]['long_prompt_tokens']}-token prefill <= 2 s: "
            f"{statistics.median(shorts):.2f} s median of {len(shorts)} "
            f"(the long prompt's TTFT {statistics.median(x['long_ttft'] for x in r['long']):.1f} s)"
        )
    for qps in sorted({k[1] for k in qa_rows}):
        one, eight = qa_rows.get(("on", qps, 1)), qa_rows.get(("on", qps, 8))
        if one and eight:
            print(
                f"target qa p95 TTFT x8 sessions <= 3x single-session (qps {qps or 'closed'}): "
                f"{eight['ttft_p95'] / one['ttft_p50']:.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
