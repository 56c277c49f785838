"""RSS under N concurrent multi-turn sessions, against the live state the requests hold.

A model with the bundled SmolLM2-135M's KV shape (30 layers x 3 KV heads x head 64, float32:
46 KB a token) and a small MLP, random weights; a 32 MB RAM tier over an SSD tier; N sessions
of 4 turns (a 350-token first prompt, 30 tokens more a turn, 32-token replies). RSS over the
engine's at start: its peak, right after the last reply, and once the engine has been idle long
enough for its heap trim; the peaks of the live state and of the blocks queued for the SSD, and
at the peak RSS what malloc had handed out (over the start) and held free (glibc's mallinfo2),
the KV buffers the pool kept free (``engines/torch/buffers.py``) and the file-backed pages.

    python benchmarks/memory_bench.py --sessions 12 32 [--max-live-bytes 256MB] [--no-malloc-tune] \
        [--rss-slack-mb 512] [--pool-free-mb 32 0] [--check-ms 1000 20]

``--rss-slack-mb``: the heap RSS may hold beyond what the engine accounts for before a trim under
load (``memory_books.RSS_SLACK_BYTES``); the rows report the trims and the time they cost.
``--check-ms``: how often, at most, RSS is held against that allowance under load
(``memory.CHECK_S``). ``--pool-free-mb``: the freed KV buffers the pool keeps at least
(``BufferPool.max_free_bytes``; on this budget it keeps no more).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import random
import tempfile
import threading
import time
from typing import Any


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t fields
    _fields_ = [(f"f{i}", ctypes.c_size_t) for i in range(10)]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (looked up once), or None."""
    name = ctypes.util.find_library("c")
    info = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    if info is not None:
        info.restype = _MallInfo2
    return info


def heap_bytes() -> tuple[int, int]:
    """(bytes malloc has handed out, bytes free inside its heap); (0, 0) without mallinfo2."""
    info = _mallinfo2()
    if info is None:
        return 0, 0
    got = info()
    return got.f7 + got.f4, got.f8  # uordblks + hblkhd (mapped), fordblks


def rss_file_bytes() -> int:
    """The resident pages that map files (``RssFile``: libraries, mapped block files), 0 where
    /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def run(
    num_sessions: int,
    max_live: str | None,
    tune: bool,
    slack_mb: int | None = None,
    pool_free_mb: int | None = None,
    check_ms: float | None = None,
) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from promptcache.engines.torch.buffers import POOL
    from promptcache.serving import memory, memory_books

    if slack_mb is not None:
        memory_books.RSS_SLACK_BYTES = slack_mb << 20
    if pool_free_mb is not None:
        POOL.max_free_bytes = pool_free_mb << 20
    if not tune:
        memory._is_tuned = True  # as if already done: glibc keeps its dynamic threshold
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=256,
                      num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=3,
                      max_position_embeddings=8192, initializer_range=0.2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as ssd_dir:  # ~0.9 GB of blocks
        return measure(model, ssd_dir, max_live, check_ms, num_sessions, tune)


def measure(
    model: Any,
    ssd_dir: str,
    max_live: str | None,
    check_ms: float | None,
    num_sessions: int,
    tune: bool,
) -> dict[str, float]:
    from promptcache.engines.base import SamplingParams
    from promptcache.engines.torch.buffers import POOL
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.serving import memory, memory_books
    from promptcache.testing.tiny_models import ByteTokenizer

    engine = TorchEngine(model, ByteTokenizer(), block_size=64, ram_budget="32MB",
                         ssd_dir=ssd_dir, max_live_bytes=max_live)  # fmt: skip
    if check_ms is not None:
        engine.heap.check_s = check_ms / 1e3
    base = memory.rss_bytes()
    peak, live_peak, queued_peak, done = [base], [0], [0], threading.Event()
    used_base = heap_bytes()[0]
    file_base = rss_file_bytes()
    at_peak = [
        (0, 0, 0, 0, 0)
    ]  # the heap (in use over the start, free) and the live KV at peak RSS

    def sample() -> None:
        while not done.is_set():
            rss = memory.rss_bytes()
            stats = engine.memory_stats()
            if rss > peak[0]:
                used, free = heap_bytes()
                at_peak[0] = (used - used_base, free, stats["live_state_bytes"],
                              stats["pooled_free_bytes"], rss_file_bytes() - file_base)  # fmt: skip
            peak[0] = max(peak[0], rss)
            live_peak[0] = max(live_peak[0], stats["live_state_bytes"])
            queued_peak[0] = max(queued_peak[0], stats["queued_write_bytes"])
            time.sleep(0.05)

    def session(k: int) -> None:
        rng = random.Random(k)
        history = [rng.randrange(3, 250) for _ in range(350)]
        for _ in range(4):
            events = list(engine.generate(history, SamplingParams(max_tokens=32)))
            history += events[-1].completion_ids + [rng.randrange(3, 250) for _ in range(30)]

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(k,)) for k in range(num_sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    end = memory.rss_bytes()
    time.sleep(memory.IDLE_TRIM_S + 1)  # the engine idle: its heap trim (memory.HeapTrim)
    return {
        "sessions": num_sessions,
        "max_live_bytes": max_live or "none",
        "malloc_tuned": tune,
        "rss_base_mb": round(base / 1e6),
        "rss_peak_over_base_mb": round((peak[0] - base) / 1e6),
        "rss_end_over_base_mb": round((end - base) / 1e6),
        "rss_idle_over_base_mb": round((memory.rss_bytes() - base) / 1e6),
        "live_state_peak_mb": round(live_peak[0] / 1e6),
        "queued_writes_peak_mb": round(queued_peak[0] / 1e6),  # inside the RAM budget
        # at peak RSS: what malloc had handed out beyond the start, what it held free, live KV
        "at_peak_heap_used_mb": round(at_peak[0][0] / 1e6),
        "at_peak_heap_free_mb": round(at_peak[0][1] / 1e6),
        "at_peak_live_state_mb": round(at_peak[0][2] / 1e6),
        "at_peak_pooled_free_mb": round(at_peak[0][3] / 1e6),  # freed KV buffers kept
        "at_peak_rss_file_over_base_mb": round(at_peak[0][4] / 1e6),  # mapped files' pages
        "ram_budget_mb": round(engine.cache.ram.budget_bytes / 1e6),
        "rss_slack_mb": memory_books.RSS_SLACK_BYTES >> 20,
        "rss_check_ms": round(engine.heap.check_s * 1e3),
        "pool_free_max_mb": POOL.max_free_bytes >> 20,
        "pool_maps": POOL.num_maps,
        "heap_trims": engine.heap.num_trims,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[12, 32])
    ap.add_argument("--max-live-bytes", default=None)
    ap.add_argument("--no-malloc-tune", action="store_true")
    ap.add_argument("--rss-slack-mb", type=int, nargs="+", default=[None],
                    help="runs at each slack (MiB; default: the engine's)")  # fmt: skip
    ap.add_argument("--check-ms", type=float, nargs="+", default=[None],
                    help="runs at each interval between RSS checks under load (ms; default: the engine's)")  # fmt: skip
    ap.add_argument("--pool-free-mb", type=int, nargs="+", default=[None],
                    help="runs at each bound on the freed KV buffers kept (MiB)")  # fmt: skip
    args = ap.parse_args()
    import multiprocessing as mp

    for n in args.sessions:  # one process per run: RSS is a process's high-water mark
        for slack in args.rss_slack_mb:
            for pool_free in args.pool_free_mb:
                for check in args.check_ms:
                    with mp.get_context("spawn").Pool(1) as pool:
                        tune = not args.no_malloc_tune
                        row = pool.apply(
                            run, (n, args.max_live_bytes, tune, slack, pool_free, check)
                        )
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
