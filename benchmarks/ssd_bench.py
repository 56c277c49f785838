"""SSD tier benchmark: write and reload throughput of the tier alone, reload throughput vs raw
disk reads, TTFT (RAM hit / SSD hit after a restart / recompute) for 2K, 4K and 8K-token
histories, and decode speed while writing.

Run: .venv/bin/python benchmarks/ssd_bench.py [--dir /path/on/the/disk] [--json out.json]
Uses the bundled model (float32, CPU). Page cache is dropped for the block files (fadvise) before
SSD reads, so they come from the disk. Only public APIs that the wave-2 commit 8487e18 also has
are used, so ``compare_commits.py`` runs these functions against either checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from promptcache.core.cache import PromptCache
from promptcache.engines.base import Finished, PrefillDone, SamplingParams
from promptcache.engines.factory import engine_class
from promptcache.models import resolve_model

try:
    from promptcache.core.tiers.factory import build_tiers
except ImportError:  # 8487e18: one module, core/tiers.py, and the old name
    from promptcache.core.tiers import make_lower_tiers as build_tiers  # type: ignore[attr-defined,no-redef]

TorchEngine = engine_class("torch")
SMOLLM2_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32


def dd_read_mb_s(folder: Path, size_mb: int = 512) -> float:
    """Raw sequential read bandwidth with direct I/O (bypasses the page cache)."""
    path = folder / "dd-probe.bin"
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={size_mb}", "oflag=direct"],
        capture_output=True,
        check=True,
    )
    out = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
        capture_output=True,
        text=True,
        check=True,
    )
    path.unlink()
    m = re.search(r"(\d+(?:\.\d+)?) bytes.*?, ([\d.]+) s,", out.stderr)
    assert m, out.stderr
    return float(m.group(1)) / float(m.group(2)) / 1e6


def drop_page_cache(folder: Path) -> None:
    for p in folder.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def flush_writes(cache: PromptCache) -> None:
    """Wait for the lower tiers' write-behind queues (``cache.tiers``; ``ram.next_tier`` at
    8487e18)."""
    stack = cache.tiers if hasattr(cache, "tiers") else cache.ram.next_tier
    stack.flush()


def tier_write_read(
    folder: Path,
    num_tokens: int = 4096,
    bytes_per_token: int = SMOLLM2_BYTES_PER_TOKEN,
    block_size: int = 64,
) -> dict[str, float]:
    """The SSD tier alone (no model): save ``num_tokens`` of KV-sized numpy blocks and wait for
    the writer (write MB/s: bytes written / save-to-flushed), then a restart with an empty RAM
    tier and a lookup that promotes them all from the disk (reload MB/s, the tier's own
    figure, and the lookup's wall time)."""
    shutil.rmtree(folder, ignore_errors=True)
    tokens = np.random.default_rng(5).integers(100, 40000, num_tokens).tolist()

    def slicer(start: int, end: int) -> dict[str, np.ndarray]:
        rows = np.random.default_rng(start).random((end - start, bytes_per_token // 8))
        return {"kv": rows}  # float64: bytes_per_token per token

    def open_cache() -> PromptCache:
        tiers = build_tiers(fingerprint="ssd-bench", ssd_dir=folder, ssd_budget="64GB")
        return PromptCache("ssd-bench", block_size=block_size, ram_budget=10**11, next_tier=tiers)

    cache = open_cache()
    payloads = [slicer(i, i + block_size) for i in range(0, num_tokens, block_size)]
    t0 = time.perf_counter()
    cache.save(cache.sequence(tokens), None, lambda s, e: payloads[s // block_size])
    flush_writes(cache)
    t_write = time.perf_counter() - t0
    written = cache.stats().tiers["ssd"]["bytes_written"]
    cache.close()
    drop_page_cache(folder)
    cache = open_cache()
    t0 = time.perf_counter()
    with cache.lookup(cache.sequence(tokens + [7])) as hit:
        t_read = time.perf_counter() - t0
        assert hit.num_tokens == num_tokens, (hit.num_tokens, num_tokens)
    ssd = cache.stats().tiers["ssd"]
    cache.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "write_mb_s": written / t_write / 1e6,
        "reload_mb_s": ssd["reload_bytes_per_s"] / 1e6,
        "promote_lookup_s": t_read,
        "bytes_written": written,
    }


def ttft(engine: Any, prompt: list[int]) -> tuple[float, int]:
    pre = next(
        e
        for e in engine.generate(prompt, SamplingParams(max_tokens=1))
        if isinstance(e, PrefillDone)
    )
    return pre.ttft_s, pre.cached_tokens


def ttft_row(
    model: Any, tok: Any, plain: Any, cache_dir: Path, n: int, g: torch.Generator
) -> dict[str, Any]:
    """An ``n``-token history saved (RAM and SSD), then a prompt extending it: TTFT from the RAM
    tier, from the SSD tier after a restart (page cache dropped), and recomputed on ``plain``
    (None: not measured, ``recompute_s`` None)."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    history = torch.randint(100, 40000, (n,), generator=g).tolist()
    prompt = history + torch.randint(100, 40000, (32,), generator=g).tolist()
    eng = TorchEngine(model, tok, ram_budget="4GB", ssd_dir=cache_dir)
    list(eng.generate(history, SamplingParams(max_tokens=1)))
    flush_writes(eng.cache)
    eng.steps.live = None  # measure a RAM-tier hit (restore from blocks), not the live-KV shortcut
    t_ram, c_ram = ttft(eng, prompt)
    eng.close()
    drop_page_cache(cache_dir)
    eng2 = TorchEngine(model, tok, ram_budget="4GB", ssd_dir=cache_dir)  # a restart: empty RAM
    t_ssd, c_ssd = ttft(eng2, prompt)
    ssd = eng2.cache.stats().tiers["ssd"]
    eng2.close()
    t_re = None if plain is None else ttft(plain, prompt)[0]
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"history_tokens": n, "ram_hit_s": t_ram, "ssd_hit_s": t_ssd, "recompute_s": t_re, "cached_ram": c_ram,
            "cached_ssd": c_ssd, "reload_mb_s": ssd["reload_bytes_per_s"] / 1e6, "reload_bytes": ssd["reload_bytes"]}  # fmt: skip


def decode_rates(
    model: Any, tok: Any, base: Path, g: torch.Generator, repeats: int, prompt_tokens: int = 4096
) -> dict[str, list[float]]:
    """Decode tokens/s right after a ``prompt_tokens`` prefill, with the writer thread busy
    with the prompt's blocks (``ssd``) and with no SSD tier (``no_ssd``), interleaved."""
    rates: dict[str, list[float]] = {"ssd": [], "no_ssd": []}
    for rep in range(repeats):
        for mode in ("ssd", "no_ssd"):
            cache_dir = base / f"decode-{mode}-{rep}"
            eng = TorchEngine(
                model, tok, ram_budget="4GB", ssd_dir=cache_dir if mode == "ssd" else None
            )
            prompt = torch.randint(100, 40000, (prompt_tokens,), generator=g).tolist()
            t_first = 0.0
            for ev in eng.generate(prompt, SamplingParams(max_tokens=64)):
                if isinstance(ev, PrefillDone):
                    t_first = time.perf_counter()
                elif isinstance(ev, Finished):
                    rates[mode].append((ev.completion_tokens - 1) / (time.perf_counter() - t_first))
            eng.close()
            shutil.rmtree(cache_dir, ignore_errors=True)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: a temp dir)")
    ap.add_argument("--sizes", default="2048,4096,8000")
    ap.add_argument("--decode-repeats", type=int, default=5, help="0 skips the decode figure")
    ap.add_argument("--json")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="pc-ssd-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    results: dict = {"dd_read_mb_s": dd_read_mb_s(base), "ttft": [], "decode": {}}
    print(f"raw disk read (dd, direct I/O): {results['dd_read_mb_s']:.0f} MB/s")

    for _ in range(3):
        results.setdefault("tier", []).append(tier_write_read(base / "tier"))
    tier = {k: statistics.median(r[k] for r in results["tier"]) for k in results["tier"][0]}
    print(f"SSD tier alone (4096 tokens of {SMOLLM2_BYTES_PER_TOKEN} B, median of 3): write "
          f"{tier['write_mb_s']:.0f} MB/s, reload after a restart {tier['reload_mb_s']:.0f} MB/s")  # fmt: skip
    plain = TorchEngine(model, tok, cache_enabled=False)
    print(
        "| history tokens | RAM hit TTFT (ms) | SSD hit after restart (ms) | recompute (ms) | SSD/RAM | SSD reload MB/s | reload / dd |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.sizes.split(",")):
        row = ttft_row(model, tok, plain, base / f"cache-{n}", n, g)
        results["ttft"].append(row)
        t_ram, t_ssd, reload_mb_s = row["ram_hit_s"], row["ssd_hit_s"], row["reload_mb_s"]
        print(f"| {n} | {t_ram * 1e3:.0f} | {t_ssd * 1e3:.0f} | {row['recompute_s'] * 1e3:.0f} | {t_ssd / t_ram:.2f} | {reload_mb_s:.0f} | "
              f"{reload_mb_s / results['dd_read_mb_s']:.2f} |", flush=True)  # fmt: skip
    if args.decode_repeats:
        rates = decode_rates(model, tok, base, g, args.decode_repeats)
        med = {k: statistics.median(v) for k, v in rates.items()}
        results["decode"] = {
            "tokens_per_s": med,
            "runs": rates,
            "ratio": med["ssd"] / med["no_ssd"],
        }
        print(f"\ndecode after a 4096-token prefill (64 tokens, median of {args.decode_repeats}): with SSD writes {med['ssd']:.1f} tok/s, "
              f"without {med['no_ssd']:.1f} tok/s, ratio {med['ssd'] / med['no_ssd']:.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
