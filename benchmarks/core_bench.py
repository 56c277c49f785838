"""Core benchmark: hashing throughput, lookup/save latency, per-block overhead, prefix sharing.

Run: .venv/bin/python benchmarks/core_bench.py [--json out.json] [--cpu-time]
Prints a table per section; medians of several repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np

from promptcache.core.cache import PromptCache
from promptcache.core.hashing import HASH_ALGORITHM, HASHERS, Namespace, tokens_to_bytes
from promptcache.core.sequence import TokenSeq

# wall time by default; ``--cpu-time`` (and compare_commits.py) use the process's CPU time,
# which neighbours on a shared machine do not inflate (everything timed here is single-threaded)
CLOCK = time.perf_counter


def median_time(fn, repeats=7):
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def bench_hashing(num_tokens=1_000_000, block_size=64):
    data = tokens_to_bytes(np.random.default_rng(0).integers(0, 50_000, num_tokens))
    root = Namespace("bench").root_hash()
    step = block_size * 4
    rows = []
    for name, digest in HASHERS.items():

        def run(digest=digest):
            parent = root
            for off in range(0, len(data) - step + 1, step):
                parent = digest(parent + data[off : off + step])

        t = median_time(run, 5)
        rows.append(
            {"algorithm": name, "tokens_per_s": num_tokens / t, "chosen": name == HASH_ALGORITHM}
        )
    # the full path the cache takes: TokenSeq from a token list, then every block hash
    tokens = np.random.default_rng(1).integers(0, 50_000, num_tokens).tolist()

    def via_seq():
        seq = TokenSeq(root, tokens, block_size)
        seq.block_hash(seq.num_full_blocks - 1)

    t = median_time(via_seq, 5)
    rows.append(
        {
            "algorithm": f"{HASH_ALGORITHM} via TokenSeq(list)",
            "tokens_per_s": num_tokens / t,
            "chosen": True,
        }
    )
    return rows


def kv_slicer(bytes_per_token):
    def slice_positional(start, end):
        return np.zeros((end - start, bytes_per_token), dtype=np.uint8)

    return slice_positional


def bench_lookup(block_size=64, bytes_per_token=64, policy=None):
    """``policy``: the RAM tier's eviction policy (None: the default)."""
    rows = []
    rng = np.random.default_rng(2)
    for n in (1_000, 10_000, 100_000):
        cache = PromptCache("bench", block_size=block_size, ram_budget=10**10, policy=policy)
        tokens = rng.integers(0, 50_000, n).tolist()
        t_save = median_time(
            lambda tokens=tokens: PromptCache(
                "bench", block_size=block_size, ram_budget=10**10, policy=policy
            ).save(
                PromptCache("bench", block_size=block_size).sequence(tokens),
                None,
                kv_slicer(bytes_per_token),
            ),
            3,
        )
        cache.save(cache.sequence(tokens), None, kv_slicer(bytes_per_token))
        query = tokens + [7, 8, 9]

        def lookup(cache=cache, query=query):
            with cache.lookup(cache.sequence(query)) as hit:
                assert hit.num_tokens == len(query) - 3

        arr = np.asarray(query, dtype=np.uint32)

        def lookup_array(cache=cache, arr=arr):
            cache.lookup(cache.sequence(arr)).release()

        rows.append(
            {
                "prompt_tokens": n,
                "lookup_ms_from_list": median_time(lookup) * 1e3,
                "lookup_ms_from_array": median_time(lookup_array) * 1e3,
                "save_ms_cold": t_save * 1e3,
            }
        )
    return rows


def bench_block_overhead(num_blocks=20_000, block_size=64, policy=None):
    cache = PromptCache("bench", block_size=block_size, ram_budget=10**10, policy=policy)
    tokens = np.random.default_rng(3).integers(0, 50_000, num_blocks * block_size).tolist()
    seq = cache.sequence(tokens)
    seq.block_hash(num_blocks - 1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache.save(seq, None, None)  # metadata only: no payload
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "blocks": num_blocks,
        "bytes_per_block": (after - before) / num_blocks,
        "block_size": block_size,
    }


def bench_sharing(
    num_sessions=100, system_tokens=1000, suffix_tokens=1000, block_size=64, bytes_per_token=256
):
    rng = np.random.default_rng(4)
    system = rng.integers(0, 50_000, system_tokens).tolist()
    cache = PromptCache("bench", block_size=block_size, ram_budget=10**11)
    for _ in range(num_sessions):
        toks = system + rng.integers(0, 50_000, suffix_tokens).tolist()
        cache.save(cache.sequence(toks), None, kv_slicer(bytes_per_token))
    cache.check_integrity()
    ideal = (system_tokens + num_sessions * suffix_tokens) * bytes_per_token
    held = cache.stats().bytes_by_tier["ram"]
    return {
        "sessions": num_sessions,
        "system_tokens": system_tokens,
        "suffix_tokens": suffix_tokens,
        "block_size": block_size,
        "held_bytes": held,
        "ideal_bytes": ideal,
        "ratio": held / ideal,
        "naive_ratio": num_sessions * (system_tokens + suffix_tokens) * bytes_per_token / ideal,
    }


def print_table(title, rows):
    print(f"\n## {title}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [
            f"{v:,.3f}"
            if isinstance(v, float)
            else f"{v:,}"
            if isinstance(v, int) and not isinstance(v, bool)
            else str(v)
            for v in r.values()
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--cpu-time", action="store_true", help="time by CPU time, not wall time")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    results = {
        "hashing": bench_hashing(),
        "lookup": bench_lookup(),
        "block_overhead": [bench_block_overhead()],
        "sharing": [
            bench_sharing(),
            bench_sharing(suffix_tokens=200),
            bench_sharing(suffix_tokens=200, block_size=16),
        ],
    }
    for k in ("hashing", "lookup", "block_overhead", "sharing"):
        print_table(k, results[k])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
