"""Decode attention of many rows, one layer: how close the row-by-row calls come to the memory
bandwidth, and what one call over a padded pool would do instead.

A decode row reads its whole context's keys and values once per layer and does ~1 FLOP per byte,
so many rows of a few thousand positions are bound by how fast the KV streams from memory. Three
timings, medians over ``--iters`` calls after a warm-up, on the bundled model's shapes (9 query
heads on 3 KV heads, head dim 64, float32):
- ``rows``: one SDPA call per row over its own buffer (``lean.attend_one``; the serving path
  where the kernel cannot be built);
- ``kernel``: every row in one call of ``rows_kernel.attend_rows`` (the serving path);
- ``pooled``: every row's KV in one ``[rows, kv_heads, capacity, dim]`` tensor and one SDPA call
  over the longest row, the shorter rows' tails masked (padding read too);
- ``stream``: a sum over as many bytes as the rows' KV, the rate one pass over memory reaches.

    PYTHONPATH=. .venv/bin/python benchmarks/rows_attention_bench.py --rows 8 32 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from promptcache.engines.torch import rows_kernel  # noqa: E402
from promptcache.engines.torch.lean import attend_one  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(num_rows: int, lo: int, hi: int, iters: int, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (num_rows,), generator=gen).tolist()
    capacity = max(lengths)
    q = torch.randn(num_rows, HEADS, 1, DIM, generator=gen)
    own = [
        (torch.randn(1, KV_HEADS, capacity, DIM), torch.randn(1, KV_HEADS, capacity, DIM))
        for _ in range(num_rows)
    ]
    pool_k = torch.randn(num_rows, KV_HEADS, capacity, DIM)
    pool_v = torch.randn(num_rows, KV_HEADS, capacity, DIM)
    mask = torch.zeros(num_rows, 1, 1, capacity)
    for r, n in enumerate(lengths):
        mask[r, :, :, n:] = float("-inf")
    folded = q.view(num_rows, KV_HEADS, HEADS // KV_HEADS, DIM)

    def rows() -> list[torch.Tensor]:
        return [
            attend_one(q[r : r + 1], k[:, :, :n], v[:, :, :n], DIM**-0.5, True)
            for r, ((k, v), n) in enumerate(zip(own, lengths, strict=True))
        ]

    op = rows_kernel.kernel()
    q_rows = q[:, :, 0].contiguous()
    keys = [k[:, :, :n] for (k, _), n in zip(own, lengths, strict=True)]
    values = [v[:, :, :n] for (_, v), n in zip(own, lengths, strict=True)]

    def kernel() -> torch.Tensor:
        return op(q_rows, keys, values, DIM**-0.5)

    if op is not None:
        err = (kernel() - torch.cat(rows(), 0)[:, :, 0]).abs().max().item()
        assert err < 1e-4, f"kernel differs from SDPA by {err}"

    def pooled() -> torch.Tensor:
        return F.scaled_dot_product_attention(folded, pool_k, pool_v, attn_mask=mask)

    kv_bytes = 2 * KV_HEADS * DIM * 4 * sum(lengths)
    flat = torch.randn(kv_bytes // 4)
    out = {"kv_mb": kv_bytes / 1e6, "padded_mb": 2 * pool_k.numel() * 4 / 1e6}
    out["rows_ms"] = median_ms(rows, iters)
    out["kernel_ms"] = median_ms(kernel, iters) if op is not None else float("nan")
    out["pooled_ms"] = median_ms(pooled, iters)
    out["stream_ms"] = median_ms(flat.sum, iters)
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    p.add_argument("--min-context", type=int, default=1000)
    p.add_argument("--max-context", type=int, default=3000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, contexts {args.min_context}-{args.max_context}, one layer")
    print("| rows | KV MB | rows: ms (GB/s) | kernel: ms (GB/s) | pooled: ms (padded MB) "
          "| stream: ms (GB/s) |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for n in args.rows:
        for rep in range(args.repeats):
            m = measure(n, args.min_context, args.max_context, args.iters, seed=rep)
            print(
                f"| {n} | {m['kv_mb']:.0f} | {m['rows_ms']:.2f} ({m['kv_mb'] / m['rows_ms']:.1f})"
                f" | {m['kernel_ms']:.2f} ({m['kv_mb'] / m['kernel_ms']:.1f})"
                f" | {m['pooled_ms']:.2f} ({m['padded_mb']:.0f}) | {m['stream_ms']:.2f}"
                f" ({m['kv_mb'] / m['stream_ms']:.1f}) |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
