"""Many long sessions in a container's memory: does the server queue them, or is it killed?

Starts ``promptcache serve`` (the bundled model) inside a memory cgroup of ``--limit-mb`` (the
way ``docker run --memory`` bounds a container), then sends ``--sessions`` chat requests at once,
each with a long prompt of its own (about ``--prompt-tokens`` tokens) and a short greedy reply.
Each ``--variant`` is one server (``default``: no flag; ``off``: ``--max-live-bytes off``;
any other value: ``--max-live-bytes VALUE``). Prints one JSON row per server: requests
answered, failed, whether the server was still up, the cgroup's peak usage and OOM kills,
and the server's own memory figures (RAM budget, cap, admission waits).

Needs root (it makes a child of this process's memory cgroup; v1 or v2 with the memory
controller delegated):

    .venv/bin/python benchmarks/container_bench.py --limit-mb 2500 --sessions 8 \\
        --prompt-tokens 5000 --variant default off
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from promptcache.models import resolve_model  # noqa: E402
from promptcache.server.launcher import ServerProcess  # noqa: E402

ROOT = Path("/sys/fs/cgroup")
_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their can has more when will would who "
    "so no if out up into do any time about its only new some could these two may first then "
    "other than like well also after did many before must through years where much your way "
    "down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three"
)
WORDS = _TEXT.split()


class Group:
    """A memory cgroup made for one server: v1 (the memory hierarchy) or v2 (unified)."""

    def __init__(self, limit_bytes: int) -> None:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), None)
        if v1 is not None:
            self.v2, base = False, ROOT / "memory" / v1.lstrip("/")
        else:
            self.v2, base = True, ROOT / lines[0].split(":", 2)[2].lstrip("/")
        self.home = base / "cgroup.procs"  # where this process goes back to
        self.path = base / f"promptcache-bench-{os.getpid()}"
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit_bytes))

    @contextmanager
    def entered(self) -> Any:
        """This process inside the group while the block runs: a child started in it stays."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            self.home.write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return -1

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with suppress(OSError):
                os.kill(int(pid), 9)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def prompt_of(k: int, num_tokens: int) -> str:
    rng = random.Random(k)
    words = [rng.choice(WORDS) for _ in range(int(num_tokens / 1.15))]
    return f"Session {k}. Summarise this text in one line:\n" + " ".join(words)


def one_server(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="container-bench-"))
    group = Group(args.limit_mb << 20)
    folder = resolve_model(None)  # the bundled model, converted outside the group
    flags = ["--model", str(folder), "--engine", "torch", "--cache-dir", str(work / "blocks")]
    if variant != "default":
        flags += ["--max-live-bytes", variant]
    env = {
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "PROMPTCACHE_HOME": str(work / "home"),
    }
    server = ServerProcess(flags, env=env, log=work / "server.log", log_level="info")
    row: dict[str, Any] = {"variant": variant, "limit_mb": args.limit_mb}
    try:
        with group.entered():
            server.start(timeout=300)
        start_stats = server.stats().get("memory", {})
        answers: list[str] = []
        lock = threading.Lock()

        def session(k: int) -> None:
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": prompt_of(k, args.prompt_tokens)}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
            }
            try:
                r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1800)
                what = str(r.status_code)
            except httpx.HTTPError as exc:
                what = type(exc).__name__
            with lock:
                answers.append(what)

        t0 = time.monotonic()
        threads = [threading.Thread(target=session, args=(k,)) for k in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        row["wall_s"] = round(time.monotonic() - t0, 1)
        row["answered_200"] = answers.count("200")
        row["failed"] = sorted(a for a in answers if a != "200")
        row["server_up"] = server.proc is not None and server.proc.poll() is None
        row["peak_mb"] = group.peak_bytes() >> 20
        row["oom_kills"] = group.oom_kills()
        row["ram_budget_mb"] = start_stats.get("ram_budget_bytes", 0) >> 20
        row["max_live_mb"] = start_stats.get("max_live_bytes", 0) >> 20
        if row["server_up"]:
            stats = server.stats()
            row["admission_waits"] = stats.get("num_admission_waits")
            row["max_batch_rows"] = stats.get("max_batch_rows")
    finally:
        server.stop(kill=True)
        group.remove()
        shutil.rmtree(work, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-mb", type=int, default=2500)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=5000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--variant", nargs="+", default=["default", "off"])
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: it makes a memory cgroup")
    for variant in args.variant:
        print(json.dumps(one_server(variant, args)), flush=True)


if __name__ == "__main__":
    main()
