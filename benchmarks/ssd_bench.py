"""SSD tier benchmark: reload throughput vs raw disk reads, TTFT (RAM hit / SSD hit after a
restart / recompute) for 2K, 4K and 8K-token histories, and decode speed while writing.

Run: .venv/bin/python benchmarks/ssd_bench.py [--dir /path/on/the/disk] [--json out.json]
Uses the bundled model (float32, CPU). Page cache is dropped for the block files (fadvise) before
SSD reads, so they come from the disk.
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

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from promptcache.engines.base import Finished, PrefillDone, SamplingParams
from promptcache.engines.torch.engine import TorchEngine
from promptcache.models import resolve_model


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


def ttft(engine: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    pre = next(
        e
        for e in engine.generate(prompt, SamplingParams(max_tokens=1))
        if isinstance(e, PrefillDone)
    )
    return pre.ttft_s, pre.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: a temp dir)")
    ap.add_argument("--sizes", default="2048,4096,8000")
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

    plain = TorchEngine(model, tok, cache_enabled=False)
    print(
        "| history tokens | RAM hit TTFT (ms) | SSD hit after restart (ms) | recompute (ms) | SSD/RAM | SSD reload MB/s | reload / dd |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.sizes.split(",")):
        cache_dir = base / f"cache-{n}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        history = torch.randint(100, 40000, (n,), generator=g).tolist()
        prompt = history + torch.randint(100, 40000, (32,), generator=g).tolist()
        eng = TorchEngine(model, tok, ram_budget="4GB", ssd_dir=cache_dir)
        list(eng.generate(history, SamplingParams(max_tokens=1)))
        eng.cache.tiers.flush()
        eng.steps.live = (
            None  # measure a RAM-tier hit (restore from blocks), not the live-KV shortcut
        )
        t_ram, c_ram = ttft(eng, prompt)
        eng.close()
        drop_page_cache(cache_dir)
        eng2 = TorchEngine(model, tok, ram_budget="4GB", ssd_dir=cache_dir)  # a restart: empty RAM
        t_ssd, c_ssd = ttft(eng2, prompt)
        ssd = eng2.cache.stats().tiers["ssd"]
        eng2.close()
        t_re, _ = ttft(plain, prompt)
        reload_mb_s = ssd["reload_bytes_per_s"] / 1e6
        row = {"history_tokens": n, "ram_hit_s": t_ram, "ssd_hit_s": t_ssd, "recompute_s": t_re, "cached_ram": c_ram,
               "cached_ssd": c_ssd, "reload_mb_s": reload_mb_s, "reload_bytes": ssd["reload_bytes"]}  # fmt: skip
        results["ttft"].append(row)
        print(f"| {n} | {t_ram * 1e3:.0f} | {t_ssd * 1e3:.0f} | {t_re * 1e3:.0f} | {t_ssd / t_ram:.2f} | {reload_mb_s:.0f} | "
              f"{reload_mb_s / results['dd_read_mb_s']:.2f} |", flush=True)  # fmt: skip
        shutil.rmtree(cache_dir, ignore_errors=True)

    # decode speed while the writer thread is busy with the prompt's blocks, vs no SSD tier
    rates: dict[str, list[float]] = {"ssd": [], "no_ssd": []}
    for rep in range(5):
        for mode in ("ssd", "no_ssd"):
            cache_dir = base / f"decode-{mode}-{rep}"
            eng = TorchEngine(
                model, tok, ram_budget="4GB", ssd_dir=cache_dir if mode == "ssd" else None
            )
            prompt = torch.randint(100, 40000, (4096,), generator=g).tolist()
            t_first = None
            for ev in eng.generate(prompt, SamplingParams(max_tokens=64)):
                if isinstance(ev, PrefillDone):
                    t_first = time.perf_counter()
                elif isinstance(ev, Finished):
                    rates[mode].append((ev.completion_tokens - 1) / (time.perf_counter() - t_first))
            eng.close()
            shutil.rmtree(cache_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    results["decode"] = {"tokens_per_s": med, "runs": rates, "ratio": med["ssd"] / med["no_ssd"]}
    print(f"\ndecode after a 4096-token prefill (64 tokens, median of 5): with SSD writes {med['ssd']:.1f} tok/s, "
          f"without {med['no_ssd']:.1f} tok/s, ratio {med['ssd'] / med['no_ssd']:.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
