"""promptcache --engine mlx vs mlx_lm.server vs vllm-mlx: TTFT per turn of one conversation,
then the next turn after a restart of each server.

Same model folder (the bundled SmolLM2-135M-Instruct, float32, MLX-ready config), same
conversation, greedy, every server on 127.0.0.1, run one after another (never side by side) so
they do not share the CPU. Each server runs the conversation with its own replies, as a client
would. TTFT is measured at the client: request sent -> first streamed content.

On Linux, MLX's bundled BLAS is slow; preload OpenBLAS for figures worth reading:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python benchmarks/mlx_peer_bench.py \\
        --conversation ../shared/data/tau_bench/gpt-4o-airline.json \\
        --vllm-mlx /path/to/venv/bin/vllm-mlx

(vllm-mlx pins an older mlx-lm: install it in a venv of its own.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from promptcache.bench import tau_conversation  # noqa: E402
from promptcache.models import mlx_ready, resolve_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    name: str, model: Path, port: int, work: Path, args: argparse.Namespace
) -> list[str]:
    if name == "promptcache":
        return [sys.executable, "-m", "promptcache.cli", "serve", "--engine", "mlx", "--model", str(model),
                "--port", str(port), "--cache-dir", str(work / "ssd")]  # fmt: skip
    if name == "mlx_lm.server":
        return [args.mlx_lm_python, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                "--host", "127.0.0.1", "--max-tokens", str(args.max_tokens)]  # fmt: skip
    if name == "vllm-mlx":
        return [args.vllm_mlx, "serve", str(model), "--port", str(port), "--host", "127.0.0.1",
                "--continuous-batching"]  # fmt: skip
    raise ValueError(name)


class Server:
    def __init__(self, name: str, model: Path, work: Path, args: argparse.Namespace) -> None:
        self.name, self.model, self.work, self.args = name, model, work, args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600) -> float:
        cmd = server_command(self.name, self.model, self.port, self.work, self.args)
        # HOME too: a peer's default on-disk cache must not leak between runs of this bench
        home = self.work / "home"
        env = {**os.environ, "PROMPTCACHE_HOME": str(home), "HOME": str(home)}
        log = open(self.work / f"{self.name}.log", "ab")  # noqa: SIM115 (owned by the child)
        t0 = time.perf_counter()
        # a session of its own: a restart must stop every process the server spawned
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.work / (self.name + '.log')}")
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).status_code
                    == 200
                ):
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not come up in {timeout} s")

    def stop(self, crash: bool = False) -> None:
        """SIGTERM (a graceful restart: servers may save state), or SIGKILL with ``crash``."""
        if self.proc is None:
            return
        for sig in (signal.SIGKILL,) if crash else (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(30)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group

    def chat(self, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        body = {"model": str(self.model), "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.read().decode()[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                usage = chunk.get("usage") or usage
        details = (usage or {}).get("prompt_tokens_details") or {}
        return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": text,
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens")}  # fmt: skip


def run_server(
    name: str, model: Path, conv: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"peer-{name}-"))
    server = Server(name, model, work, args)
    load_s = server.start()
    print(f"{name}: up in {load_s:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    try:
        for msg in conv:
            if msg["content"] is not None:
                history.append(msg)
                continue
            turn = len(rows) + 1
            restarted = turn == args.turns + 1
            if restarted:  # the next turn, after a restart
                server.stop(crash=args.restart == "kill")
                server.start()
            got = server.chat(history, args.max_tokens)
            rows.append({"server": name, "turn": turn, "after_restart": restarted,
                         **{k: v for k, v in got.items() if k != "text"}})  # fmt: skip
            print(f"  turn {turn}{' (after restart)' if restarted else ''}: TTFT {got['ttft_s'] * 1e3:.0f} ms,"
                  f" prompt {got['prompt_tokens']}, cached {got['cached_tokens']}", flush=True)  # fmt: skip
            history.append({"role": "assistant", "content": got["text"]})
            if restarted:
                break
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def print_table(rows: list[dict[str, Any]], repeats: int) -> None:
    """Per turn: each server's median TTFT over the runs, with the cached tokens it reported."""
    names = list(dict.fromkeys(r["server"] for r in rows))
    print(f"\nmedian of {repeats} run(s)")
    print("\n| turn | prompt tok | " + " | ".join(f"{n} TTFT ms (cached)" for n in names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for turn in sorted({r["turn"] for r in rows}):
        by = {n: [r for r in rows if r["turn"] == turn and r["server"] == n] for n in names}
        first = next(r for r in rows if r["turn"] == turn)
        label = f"{turn} (restart)" if first["after_restart"] else str(turn)
        cells = []
        for n in names:
            if not by[n]:
                cells.append("-")
                continue
            ms = statistics.median(r["ttft_s"] for r in by[n]) * 1e3
            cached = by[n][0]["cached_tokens"]
            cells.append(f"{ms:.0f} ({cached if cached is not None else 'n/a'})")
        print(f"| {label} | {first['prompt_tokens']} | " + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", required=True, help="a tau-bench trajectory file (JSON)")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--turns", type=int, default=8, help="turns before the restart (default 8)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="HF-format folder (default: the bundled model)")
    p.add_argument(
        "--mlx-lm-python", default=sys.executable, help="python with mlx-lm for mlx_lm.server"
    )
    p.add_argument("--vllm-mlx", default=shutil.which("vllm-mlx"), help="the vllm-mlx executable")
    p.add_argument("--restart", choices=("term", "kill"), default="term",
                   help="how the server is stopped before the last turn: SIGTERM (graceful) or SIGKILL (a crash)")  # fmt: skip
    p.add_argument("--servers", default="promptcache,mlx_lm.server,vllm-mlx")
    p.add_argument("--repeats", type=int, default=1, help="whole runs; the table shows medians")
    p.add_argument("--out", default="bench-out/mlx_peers.json")
    args = p.parse_args()
    model = mlx_ready(resolve_model(args.model))
    conv = tau_conversation(args.conversation, args.index)
    rows: list[dict[str, Any]] = []
    for run in range(args.repeats):
        for name in args.servers.split(","):
            if name == "vllm-mlx" and not args.vllm_mlx:
                print("vllm-mlx: not installed (pass --vllm-mlx), skipped")
                continue
            print(f"run {run + 1}/{args.repeats}", end=" ")
            rows += [{**r, "run": run} for r in run_server(name, model, conv, args)]
    print_table(rows, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model), "conversation": f"{args.conversation}[{args.index}]",
                               "max_tokens": args.max_tokens, "restart": args.restart, "repeats": args.repeats, "rows": rows}, indent=2))  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
