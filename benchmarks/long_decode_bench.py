"""One conversation at long context, promptcache and vLLM-CPU side by side (one server at a time):
cold prefill, warm TTFT (the same prompt again: a cache hit on both) and decode speed there.

For each ``--contexts`` size a prompt of about that many tokens (seeded words, its own per size
and repeat, so nothing is warm from before) is sent twice with ``--decode`` reply tokens
(greedy, ``ignore_eos``): the first send's TTFT is the cold prefill, the second's the warm TTFT;
decode tok/s is over the second reply (tokens after the first / their span at the client).
Servers alternate by repeat (A B, B A, ...): medians over ``--repeats``, every run in the JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/long_decode_bench.py --contexts 1000 6500 \\
        --servers promptcache,vllm_cpu --vllm-python .venv-vllm/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from load_bench import command, words  # noqa: E402
from peer_bench import server_compute  # noqa: E402
from peer_server import PeerServer, free_port  # noqa: E402

from promptcache.models import resolve_model  # noqa: E402

WORDS_PER_TOKEN = 1.0  # about one token a word on these seeded words (prompt_tokens shown)


def run_size(server: PeerServer, size: int, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(f"{size}/{rep}")
    text = "Summarize the notes below.\n" + words(rng, int(size * WORDS_PER_TOKEN))
    msgs = [{"role": "user", "content": text}]
    extra = {"ignore_eos": True}
    cold = server.chat(msgs, args.decode, extra)
    warm = server.chat(msgs, args.decode, extra)
    row = {
        "server": server.name, "context": size, "repeat": rep,
        "prompt_tokens": warm["prompt_tokens"], "cached_tokens": warm["cached_tokens"],
        "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"],
        "decode_tok_s": warm["decode_tok_s"], "cold_decode_tok_s": cold["decode_tok_s"],
        "gap_p50_ms": warm["gap_p50_ms"], "gap_max_ms": warm["gap_max_ms"],
        "load": os.getloadavg()[0],
        **{k: v for k, v in server_compute(server).items() if k in ("torch_threads", "thread_changes")},
    }  # fmt: skip
    print(f"  {server.name:<12} {size:>6}: prompt {row['prompt_tokens']}, cold {row['cold_ttft_s']:.2f} s, "
          f"warm {row['warm_ttft_s']:.3f} s (cached {row['cached_tokens']}), decode "
          f"{row['decode_tok_s'] or 0:.1f} tok/s (gaps p50 {row['gap_p50_ms'] or 0:.1f} ms, max "
          f"{row['gap_max_ms'] or 0:.0f} ms), load {row['load']:.1f}"
          + (f", torch threads {row['torch_threads']} ({row['thread_changes']} changes)"
             if "torch_threads" in row else ""), flush=True)  # fmt: skip
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", default="promptcache,vllm_cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[1000, 6500])
    p.add_argument("--decode", type=int, default=128, help="reply tokens per request")
    p.add_argument("--context", type=int, default=8192, help="context the servers start with")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    p.add_argument("--vllm-python", default=os.environ.get("PROMPTCACHE_VLLM_PYTHON")
                   or ".venv-vllm/bin/python")  # fmt: skip
    p.add_argument("--serve-flags", default="", help="extra flags for the promptcache server")
    p.add_argument("--out", default=None, help="a JSON file for every run")
    args = p.parse_args()
    args.folder = resolve_model(args.model)
    args.variants = {}
    names = [s for s in args.servers.split(",") if s]
    if "vllm_cpu" in names and not Path(args.vllm_python).exists():
        print(f"vllm_cpu skipped: no python at {args.vllm_python} (make vllm-env)")
        names.remove("vllm_cpu")
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            work = Path(tempfile.mkdtemp(prefix=f"long-{name}-"))
            port = free_port()
            server = PeerServer(name, command(name, port, work, args), port, work)
            try:
                print(f"{name} (repeat {rep + 1}): up in {server.start():.1f} s", flush=True)
                server.chat([{"role": "user", "content": "hello"}], 4)  # first-request set-up
                rows += [run_size(server, size, rep, args) for size in args.contexts]
            finally:
                server.stop()
                shutil.rmtree(work, ignore_errors=True)
    print("\n| context | server | prompt tokens | cold prefill | warm TTFT | decode tok/s | runs |")
    print("|---|---|---|---|---|---|---|")
    for size in args.contexts:
        for name in names:
            cell = [r for r in rows if r["server"] == name and r["context"] == size]
            if not cell:
                continue

            def med(key: str, cell: list[dict[str, Any]] = cell) -> float:
                return statistics.median(r[key] or 0.0 for r in cell)

            each = ", ".join(f"{r['decode_tok_s'] or 0:.1f}" for r in cell)
            print(f"| {size} | {name} | {cell[0]['prompt_tokens']} | {med('cold_ttft_s'):.2f} s | "
                  f"{med('warm_ttft_s'):.3f} s | {med('decode_tok_s'):.1f} ({each}) | {len(cell)} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
