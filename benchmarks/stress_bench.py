"""Stress a real server on a tight RAM budget, then crash it: issue 35's "Done when" check.

Per run: `promptcache serve --ram-budget 32MB` (the bundled model, an SSD cache dir in a temp
folder) serves 12 concurrent 4-turn conversations (half streamed, official `openai` client,
greedy) with bad requests mixed in; then three cycles of: restart on the same cache dir, the
conversations with new follow-ups, kill -9 while block writes are queued, `promptcache cache
verify` on the dir. After the last kill a restarted server serves the conversations once more
and its replies are compared with a `--no-cache` server's. Counted: 5xx (and errors inside
streams), "Traceback" lines in the server's log, bad requests not answered 4xx, blocks verify
finds bad, conversations whose replies differ from the uncached ones.

`--memory`: the server's RSS (/proc/PID/status VmRSS) and its `/v1/cache/stats` memory figures
sampled under 12 and 32 concurrent sessions, default flags and `--max-live-bytes 256MB`.

    python benchmarks/stress_bench.py --runs 10 [--max-tokens 32] [--out DIR]
    python benchmarks/stress_bench.py --runs 0 --memory
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from stress_load import Outcomes, make_conversations, run_conversations, send_bad  # noqa: E402

from promptcache.server.launcher import ServerProcess  # noqa: E402

# the huge max_tokens is refused (400) rather than clamped to the room left (200, by design)
SERVE_FLAGS = ["--ram-budget", "32MB", "--strict-max-tokens"]


def serve(work: Path, name: str, extra: list[str]) -> ServerProcess:
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's promptcache
    return ServerProcess(
        [*SERVE_FLAGS, *extra], env=env, log=work / f"{name}.log", log_level="info"
    )


def rss_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stats_of(server: ServerProcess) -> dict[str, Any]:
    try:
        return server.stats()
    except (httpx.HTTPError, ValueError):
        return {}


def load(server: ServerProcess, convs: list, max_tokens: int, out: Outcomes, kill_after: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The conversations and the bad requests together; with ``kill_after``: kill -9 once that
    many seconds have passed and the SSD tier has writes queued (or 60 s more have)."""
    stop = threading.Event()
    bad = threading.Thread(target=send_bad, args=(server.url, stop, out), daemon=True)
    bad.start()
    threads = run_conversations(server.url, convs, max_tokens, out)
    info: dict[str, Any] = {}
    if kill_after is not None:
        t0 = time.monotonic()
        while True:
            ssd = stats_of(server).get("tiers", {}).get("ssd", {})
            late = time.monotonic() - t0
            if late >= kill_after and (ssd.get("queued_writes", 0) > 0 or late > kill_after + 60):
                break
            time.sleep(0.05)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        info = {"killed_at_s": round(late, 1), "queued_writes": ssd.get("queued_writes", 0)}
    for t in threads:
        t.join()
    stop.set()
    bad.join()
    return info


def verify(cache_dir: Path) -> tuple[int, int]:
    cmd = [
        sys.executable,
        "-m",
        "promptcache.cli",
        "cache",
        "verify",
        "--cache-dir",
        str(cache_dir),
    ]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    m = re.search(r"(\d+) blocks checked, (\d+) bad", done.stdout)
    if not m:
        raise RuntimeError(f"cache verify said: {done.stdout[-500:]} {done.stderr[-2000:]}")
    return int(m[1]), int(m[2])


def tracebacks(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return ["\n".join(lines[i : i + 40]) for i, line in enumerate(lines) if "Traceback" in line]


def reference(work: Path, convs: list, max_tokens: int, memo: dict[str, list[str]]) -> None:
    """The uncached replies of ``convs`` (from a `--no-cache` server), once per conversation."""
    todo = [c for c in convs if c.key not in memo]
    if not todo:
        return
    server = serve(work, "nocache", ["--no-cache"]).start(timeout=600)
    try:
        out = Outcomes()
        for t in run_conversations(server.url, todo, max_tokens, out):
            t.join()
        if out.counts["ok"] != sum(len(c.user_turns) for c in todo):
            raise RuntimeError(f"the --no-cache server failed: {dict(out.counts)} {out.errors}")
        memo.update(out.replies)
    finally:
        server.stop()


def one_run(run: int, args: argparse.Namespace, memo: dict[str, list[str]]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"stress{run}-"))
    server = serve(work, "server", ["--cache-dir", str(work / "ssd")])
    try:
        return _one_run(run, args, memo, work, server)
    finally:
        server.stop(kill=True)
        shutil.rmtree(work, ignore_errors=True)


def _one_run(run: int, args: argparse.Namespace, memo: dict[str, list[str]], work: Path, server: ServerProcess) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(f"{args.seed}/{run}")
    cache_dir = work / "ssd"
    out, kills, checked, bad_blocks = Outcomes(), [], 0, 0
    t0 = time.monotonic()
    server.start(timeout=600)
    load(server, make_conversations(args.sessions, args.turns), args.max_tokens, out)
    for cycle in range(
        1, args.kills + 1
    ):  # the server up: new follow-ups, kill -9, verify, restart
        convs = make_conversations(args.sessions, args.turns, variant=cycle)
        kills.append(load(server, convs, args.max_tokens, out, kill_after=rng.uniform(1, 8)))
        n, bad = verify(cache_dir)
        checked, bad_blocks = checked + n, bad_blocks + bad
        server.start(timeout=600)
    after = Outcomes()  # the conversations once more, each variant: blocks from before each kill
    variants = [make_conversations(args.sessions, args.turns, v) for v in range(args.kills + 1)]
    convs = [variants[k % len(variants)][k] for k in range(args.sessions)]
    load(server, convs, args.max_tokens, after)
    stats = stats_of(server)
    server.stop()
    reference(Path(args.ref_dir), convs, args.max_tokens, memo)
    equal = sum(after.replies.get(c.key) == memo[c.key] for c in convs)
    for key, value in after.counts.items():
        out.counts[key] += value
    out.errors += after.errors
    tbs = tracebacks(work / "server.log")
    if args.out and (tbs or out.counts["5xx"] or out.counts["stream_error"]):
        shutil.copy(work / "server.log", Path(args.out) / f"server-run{run}.log")
    row = {
        "run": run,
        "requests_ok": out.counts["ok"],
        "http_5xx": out.counts["5xx"],
        "stream_errors": out.counts["stream_error"],
        "other_4xx_on_good": sum(v for k, v in out.counts.items() if k.isdigit()),
        "cut_by_kill": out.counts["cut"] + out.counts["bad_cut"],
        "bad_sent": out.counts["bad_4xx"] + out.counts["bad_not_4xx"],
        "bad_not_4xx": out.counts["bad_not_4xx"],
        "tracebacks": len(tbs),
        "verify_checked": checked,
        "verify_bad": bad_blocks,
        "equal_to_nocache": f"{equal}/{len(convs)}",
        "kills": kills,
        "step_failures": stats.get("num_step_failures"),
        "integrity_failures": stats.get("num_integrity_failures"),
        "temp_removed": stats.get("tiers", {}).get("ssd", {}).get("num_temp_removed"),
        "policy_leader": stats.get("policy_leader"),
        "seconds": round(time.monotonic() - t0),
        "errors": out.errors[:5],
        "traceback_text": tbs[:2],
    }
    return row


def memory_row(sessions: int, extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """RSS and the stats' memory figures sampled every 0.1 s under ``sessions`` conversations."""
    work = Path(tempfile.mkdtemp(prefix="stressmem-"))
    server = serve(work, "server", ["--cache-dir", str(work / "ssd"), *extra]).start(timeout=600)
    assert server.proc is not None
    pid = server.proc.pid
    warm = Outcomes()
    for t in run_conversations(
        server.url, make_conversations(1, 1, variant=99), args.max_tokens, warm
    ):
        t.join()
    base = rss_of(pid)
    peak = {"rss": base, "live": 0, "ram": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = stats_of(server)
            peak["rss"] = max(peak["rss"], rss_of(pid))
            peak["live"] = max(peak["live"], s.get("memory", {}).get("live_state_bytes", 0))
            peak["ram"] = max(peak["ram"], s.get("bytes_by_tier", {}).get("ram", 0))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, t0 = Outcomes(), time.monotonic()
    for t in run_conversations(
        server.url, make_conversations(sessions, args.turns), args.max_tokens, out
    ):
        t.join()
    seconds = time.monotonic() - t0
    done.set()
    sampler.join()
    time.sleep(2)
    stats = stats_of(server)
    after = rss_of(pid)
    server.stop()
    shutil.rmtree(work, ignore_errors=True)
    mb = 1e6
    return {
        "sessions": sessions,
        "flags": " ".join(extra) or "default",
        "rss_base_mb": round(base / mb),
        "rss_peak_mb": round(peak["rss"] / mb),
        "rss_after_mb": round(after / mb),
        "live_state_peak_mb": round(peak["live"] / mb),
        "ram_tier_peak_mb": round(peak["ram"] / mb, 1),
        "ram_tier_end_mb": round(stats.get("bytes_by_tier", {}).get("ram", 0) / mb, 1),
        "admission_waits": stats.get("num_admission_waits"),
        "requests_ok": out.counts["ok"],
        "http_5xx": out.counts["5xx"] + out.counts["stream_error"],
        "seconds": round(seconds),
    }


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c)).rjust(w) for c, w in zip(cols, widths, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="the kill times")
    ap.add_argument(
        "--out", default=None, help="folder for the logs of runs with a 5xx or traceback"
    )
    ap.add_argument("--memory", action="store_true", help="also the memory table")
    ap.add_argument("--memory-sessions", type=int, nargs="+", default=[12, 32])
    args = ap.parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    args.ref_dir = tempfile.mkdtemp(prefix="stress-nocache-")
    try:
        run_all(args)
    finally:
        shutil.rmtree(args.ref_dir, ignore_errors=True)


def run_all(args: argparse.Namespace) -> None:
    rows, memo = [], {}  # type: ignore[var-annotated]
    for run in range(1, args.runs + 1):
        rows.append(one_run(run, args, memo))
        print(json.dumps(rows[-1]), flush=True)
    if rows:
        cols = ["run", "requests_ok", "http_5xx", "stream_errors", "tracebacks", "bad_sent",
                "bad_not_4xx", "cut_by_kill", "verify_checked", "verify_bad", "equal_to_nocache",
                "step_failures", "seconds"]  # fmt: skip
        print_table(rows, cols)
        bad_runs = sum(bool(r["http_5xx"] or r["stream_errors"] or r["tracebacks"]) for r in rows)
        print(f"runs with a 5xx or a traceback: {bad_runs} of {len(rows)}")
    mem = []
    if args.memory:
        for extra in ([], ["--max-live-bytes", "256MB"]):
            for n in args.memory_sessions:
                mem.append(memory_row(n, extra, args))
                print(json.dumps(mem[-1]), flush=True)
        print_table(mem, list(mem[0]))


if __name__ == "__main__":
    main()
