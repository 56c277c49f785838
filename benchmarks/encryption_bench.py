"""Cost of encryption at rest on SSD reloads: the same blocks read back through the SSD tier
(checksums, chained hashes, index rows verified) in plaintext and under ``--encrypt-key-file``.

Run: .venv/bin/python benchmarks/encryption_bench.py [--dir /path/on/the/disk] [--blocks 256]
     [--block-mb 1.5] [--json out.json]
Blocks are sized like SmolLM2-135M's at 64 tokens (30 layers x K,V x 3 heads x 64 x 64 x f32 is
about 2.8 MB; the default 1.5 MB sits between small and large models' per-block sizes). Each
mode is read twice: page cache dropped (fadvise, from the disk) and warm (the CPU cost alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from promptcache.core.cipher import BlockCipher
from promptcache.core.hashing import Namespace
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import BlockRecord, StoredBlock
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK_TOKENS = 64


def drop_page_cache(folder: Path) -> None:
    for p in folder.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(folder: Path, cipher: BlockCipher | None, n: int, block_bytes: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    seq = TokenSeq(
        Namespace("bench").root_hash(), rng.integers(0, 50_000, n * BLOCK_TOKENS), BLOCK_TOKENS
    )
    payload = rng.standard_normal(block_bytes // 4).astype(np.float32)
    tier = SsdTier(folder, "bench", cipher=cipher, budget_bytes=10**12, queue_blocks=n + 1)
    t0 = time.perf_counter()
    for i in range(n):
        tier.put(BlockRecord(seq.block_meta(i), payload, None, payload.nbytes, False))
    tier.flush(600)
    write_s = time.perf_counter() - t0
    blocks = [StoredBlock(seq.block_meta(i), payload.nbytes, False, False) for i in range(n)]
    out = {"write_mb_s": n * block_bytes / write_s / 1e6}
    for label, cold in (("cold", True), ("warm", False)):
        rates = []
        for _ in range(3):
            if cold:
                drop_page_cache(tier.root_dir)
            t0 = time.perf_counter()
            for k in range(0, n, 16):  # a promotion reads a chain of blocks at once
                res = tier.read(blocks[k : k + 16])
                assert not any(isinstance(r, Exception) for r in res), res
            rates.append(n * block_bytes / (time.perf_counter() - t0) / 1e6)
        out[f"reload_{label}_mb_s"] = statistics.median(rates)
    tier.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-mb", type=float, default=1.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    block_bytes = int(args.block_mb * 1e6) // 4 * 4
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="pc-enc-bench-"))
    results = {}
    for mode, cipher in (("plain", None), ("aes-256-gcm", BlockCipher(os.urandom(32)))):
        results[mode] = run(base / mode, cipher, args.blocks, block_bytes)
    p, e = results["plain"], results["aes-256-gcm"]
    print(f"{args.blocks} blocks of {block_bytes / 1e6:.2f} MB under {base}")
    print(f"{'MB/s':<14} {'plain':>10} {'encrypted':>10} {'cost':>7}")
    for key in ("write_mb_s", "reload_cold_mb_s", "reload_warm_mb_s"):
        print(f"{key:<14} {p[key]:>10.0f} {e[key]:>10.0f} {1 - e[key] / p[key]:>7.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
