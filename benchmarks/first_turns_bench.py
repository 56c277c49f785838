"""N first turns at once on the bundled model, in process: when each first token comes, and
what each request's restore of the shared prefix took.

Every session sends the same ``--shared``-token prefix (an agent's system prompt) and
``--own`` tokens of its own, all at once, 32 tokens out (greedy). The first request prefills
the prefix while the others wait for it (they share it), then they restore it from the cache
and prefill their own tokens, a few per step. A restore copies the prefix's KV into new
buffers: where those are fresh pages, the copy pays their first touch (on a VM whose host backs
a page at first touch, ~14 us a page against ~2 for one the guest reused).
``--reserve-mb`` sets the KV buffers faulted in at start (``memory_books.RESERVE_BYTES``; 0:
none), one process per value, alternating over ``--runs``.

    .venv/bin/python benchmarks/first_turns_bench.py --sessions 16 --reserve-mb 0 256 --runs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(num_sessions: int, shared: int, own: int, reserve_mb: int) -> dict[str, object]:
    """In a child process: one round of first turns; first-token times and restore times."""
    from promptcache.engines.base import SamplingParams, TextDelta
    from promptcache.engines.factory import build_engine
    from promptcache.serving import memory_books

    memory_books.RESERVE_BYTES = reserve_mb << 20
    folder = tempfile.mkdtemp(prefix="first-turns-")
    try:
        engine = build_engine("torch", None, ssd_dir=folder)
        restores: list[float] = []
        restore = engine.runner.restore

        def timed_restore(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            out = restore(*args, **kwargs)
            restores.append(time.perf_counter() - t0)
            return out

        engine.runner.restore = timed_restore  # this benchmark's own engine: a timing wrapper
        rng = random.Random(1)
        prefix = [rng.randrange(100, 40000) for _ in range(shared)]
        firsts: dict[int, float] = {}
        t0 = time.perf_counter()

        def session(k: int) -> None:
            mine = random.Random(100 + k)
            ids = prefix + [mine.randrange(100, 40000) for _ in range(own)]
            for ev in engine.generate(ids, SamplingParams(max_tokens=32, ignore_eos=True)):
                if isinstance(ev, TextDelta) and k not in firsts:
                    firsts[k] = time.perf_counter() - t0

        threads = [threading.Thread(target=session, args=(k,)) for k in range(num_sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times = sorted(firsts.values())
        return {
            "sessions": num_sessions,
            "reserve_mb": reserve_mb,
            "first_tokens_s": [round(x, 2) for x in times],
            "last_first_token_s": round(times[-1], 2),
            "restore_ms": [round(x * 1e3, 1) for x in restores],
            "restore_ms_median": round(statistics.median(restores) * 1e3, 1) if restores else 0,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--shared", type=int, default=657, help="tokens every session shares")
    ap.add_argument("--own", type=int, default=88, help="tokens of each session's own")
    ap.add_argument("--reserve-mb", type=int, nargs="+", default=[0, 256])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    for run_index in range(args.runs):
        order = args.reserve_mb if run_index % 2 == 0 else args.reserve_mb[::-1]
        for mb in order:  # one process each: fresh memory, as a server's start
            with mp.get_context("spawn").Pool(1) as pool:
                row = pool.apply(run, (args.sessions, args.shared, args.own, mb))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
