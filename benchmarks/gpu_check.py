"""The GPU path in one prepared run (``--device cuda``), for a session that has a GPU machine.

Nothing can be downloaded there, so everything it needs travels with the checkout or is built
there: tiny random-weight models of several families (``promptcache.testing``) are saved to a
folder and served on CUDA through ``TorchEngine.load(..., device="cuda")``. For each family and
dtype it checks that greedy replies with the cache on equal those with it off over a multi-turn
conversation, that later turns hit the cache, and that concurrent requests decode in shared
forwards.

``--model DIR`` adds a real architecture: a model folder, or (``--random-weights``) just its
config and tokenizer (the bundled model's weights are over what a call can carry; speed does not
depend on the weights' values), drawn at the config's ``initializer_range``. On it: a 6-turn
conversation cache on vs off (equal replies, first-token time per turn), one request's decode
tokens/s at each ``--contexts`` length, and N concurrent 4-turn agent-like sessions for each
``--load`` N (output tokens/s, TTFT p50/p99 of turns >= 2, cached share, peak GPU memory);
``--compile-check``: one request's decode eager vs ``--compile``.

    python benchmarks/gpu_check.py --out OUT_DIR [--model DIR [--random-weights]]
        [--dtypes float32 bfloat16] [--load 1 4 16 32] [--contexts 1000 6000] [--compile-check]

Prints one JSON line per check and a summary; exits 1 when an error or a float32 equality check
fails (bfloat16 rounds a suffix over cached KV differently from a full prefill: its share of
equal reply tokens is reported).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# attention, sliding windows, SSM, attention and SSM in one layer
FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_next", "nemotron_h", "falcon_h1")


def run_request(engine: Any, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> dict:
    """One request: its first-token time, decode tokens/s after it, cached tokens, reply."""
    from promptcache.engines.base import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    first = None
    fin = None
    for ev in engine.generate(prompt, params):
        if first is None and getattr(ev, "token_ids", None):
            first = time.perf_counter()
        fin = ev
    end = time.perf_counter()
    first = first or end
    n = len(fin.completion_ids)
    return {
        "ttft_s": first - t0, "total_s": end - t0, "cached": fin.cached_tokens,
        "prompt": fin.prompt_tokens, "reply": fin.completion_ids,
        "decode_tok_s": (n - 1) / (end - first) if n > 1 and end > first else None,
    }  # fmt: skip


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of reply tokens equal before each turn's first difference (1.0: identical)."""
    same = 0
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += k
    return round(same / max(1, sum(len(x) for x in b)), 3)


def conversation(engine: Any, turns: int, start: list[int], max_tokens: int = 16) -> dict:
    prompt = list(start)
    out: dict[str, list] = {"ttft_s": [], "cached": [], "replies": []}
    for turn in range(turns):
        r = run_request(engine, prompt, max_tokens)
        out["ttft_s"].append(round(r["ttft_s"], 4))
        out["cached"].append(r["cached"])
        out["replies"].append(r["reply"])
        prompt = prompt + r["reply"] + [7 + turn] * 20
    return out


def check_family(family: str, root: Path, dtype: str, device: str) -> dict:
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_families import save_family

    path = save_family(family, root / family)
    on = TorchEngine.load(path, device=device, dtype=dtype, block_size=16)
    off = TorchEngine.load(path, device=device, dtype=dtype, block_size=16, cache_enabled=False)
    start = list(range(5, 90))
    a, b = conversation(on, 4, start), conversation(off, 4, start)
    threads = [
        threading.Thread(target=conversation, args=(on, 1, [9 + i, *start[i:]])) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "family": family, "dtype": dtype, "equal": a["replies"] == b["replies"],
        "agreement": agreement(a["replies"], b["replies"]),
        "cached_per_turn": a["cached"], "hits_after_first": all(c > 0 for c in a["cached"][1:]),
        "max_batch_rows": on.cache_stats().get("max_batch_rows"),
        "ttft_on_s": a["ttft_s"], "ttft_off_s": b["ttft_s"],
    }  # fmt: skip


def materialize(folder: Path, into: Path) -> Path:
    """``folder``'s config and tokenizer with weights drawn at its ``initializer_range`` (seed 0),
    saved as a model folder (float32) the engine loads as a user's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(into)
    for f in folder.iterdir():
        if f.is_file() and not (into / f.name).exists():
            shutil.copy(f, into / f.name)
    return into


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def load_cell(engine: Any, n: int, vocab: int, turns: int = 4) -> dict:
    """``n`` sessions at once, each ``turns`` turns: a shared 600-token prefix and 400 of its own,
    then its reply and a 150-token tool result per turn; 32-token replies (end of turn ignored)."""
    import torch

    rng = random.Random(n)
    shared = tokens(rng, 600, vocab)
    firsts = [shared + tokens(rng, 400, vocab) for _ in range(n)]
    results: list[list[dict]] = [[] for _ in range(n)]

    def session(i: int) -> None:
        local = random.Random(1000 + i)
        prompt = firsts[i]
        for _ in range(turns):
            r = run_request(engine, prompt, 32, ignore_eos=True)
            results[i].append(r)
            prompt = prompt + r["reply"] + tokens(local, 150, vocab)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    later = sorted(r["ttft_s"] for rs in results for r in rs[1:])
    return {
        "sessions": n, "output_tok_s": round(sum(len(r["reply"]) for r in flat) / wall, 1),
        "ttft_p50_s": round(statistics.median(later), 3),
        "ttft_p99_s": round(later[min(len(later) - 1, int(0.99 * len(later)))], 3),
        "cached_share": round(sum(r["cached"] for r in flat) / sum(r["prompt"] for r in flat), 3),
        "wall_s": round(wall, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available() else None,
    }  # fmt: skip


def check_model(args: argparse.Namespace, path: Path, dtype: str) -> list[dict]:
    from promptcache.engines.torch.engine import TorchEngine

    rows: list[dict] = []
    on = TorchEngine.load(path, device=args.device, dtype=dtype)
    # the default cap on the running requests' state: a share of the device's free memory
    free = on.runner.device_free_bytes()
    rows.append({"model": path.name, "dtype": dtype, "device_free_bytes": free,
                 "max_live_bytes": on.max_live_bytes,
                 "cap_within_free": free is not None and 0 < (on.max_live_bytes or 0) <= free})  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    off = TorchEngine.load(path, device=args.device, dtype=dtype, cache_enabled=False)
    vocab = on.limits.vocab_size
    start = tokens(random.Random(0), 500, vocab)
    run_request(on, start[:50], 4)  # warm-up: CUDA context, kernels' first launch
    run_request(off, start[:50], 4)
    a, b = conversation(on, 6, start), conversation(off, 6, start)
    rows.append({"model": path.name, "dtype": dtype, "equal": a["replies"] == b["replies"],
                 "agreement": agreement(a["replies"], b["replies"]),
                 "ttft_on_s": a["ttft_s"], "ttft_off_s": b["ttft_s"], "cached": a["cached"]})  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    del off
    for n_ctx in args.contexts:
        prompt = tokens(random.Random(n_ctx), n_ctx, vocab)
        cold = run_request(on, prompt, args.decode_tokens, ignore_eos=True)
        warm = run_request(on, prompt, args.decode_tokens, ignore_eos=True)
        rows.append({"model": path.name, "dtype": dtype, "context": n_ctx,
                     "cold_ttft_s": round(cold["ttft_s"], 3), "warm_ttft_s": round(warm["ttft_s"], 3),
                     "decode_tok_s": [round(cold["decode_tok_s"], 1), round(warm["decode_tok_s"], 1)],
                     "equal_cold_warm": cold["reply"] == warm["reply"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    for n in args.load:
        try:
            rows.append({"model": path.name, "dtype": dtype, **load_cell(on, n, vocab)})
        except Exception as exc:
            rows.append({"model": path.name, "dtype": dtype, "sessions": n, "error": repr(exc)})
        print(json.dumps(rows[-1]), flush=True)
    rows[-1]["max_batch_rows"] = on.cache_stats().get("max_batch_rows")
    return rows


def compile_check(path: Path, dtype: str, device: str) -> dict:
    """``--compile`` on this device: one request's decode tokens/s eager vs compiled (3 prompts
    of 1,000 tokens, 64 tokens each, cache off), and whether their greedy tokens are the same."""
    from promptcache.engines.torch.engine import TorchEngine

    prompt = tokens(random.Random(1), 1000, 49152)
    eager = TorchEngine.load(path, device=device, dtype=dtype, cache_enabled=False)
    fast = TorchEngine.load(path, device=device, dtype=dtype, cache_enabled=False, compile=True)
    e = [run_request(eager, prompt + [i], 64, ignore_eos=True) for i in range(3)]
    f = [run_request(fast, prompt + [i], 64, ignore_eos=True) for i in range(3)]
    return {
        "model": path.name, "dtype": dtype, "compile_s": round(fast.compile_s or 0.0, 1),
        "eager_decode_tok_s": [round(x["decode_tok_s"], 1) for x in e],
        "compiled_decode_tok_s": [round(x["decode_tok_s"], 1) for x in f],
        "equal": all(x["reply"] == y["reply"] for x, y in zip(e, f, strict=True)),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None)
    p.add_argument("--model", help="a model folder (or config + tokenizer: --random-weights)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    p.add_argument("--contexts", nargs="*", type=int, default=[1000, 6000])
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--load", nargs="*", type=int, default=[1, 4, 16, 32])
    p.add_argument("--compile-check", action="store_true", help="--model: eager vs --compile")
    p.add_argument("--device", default="cuda", help="cpu: try the script itself anywhere")
    args = p.parse_args()
    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "torch": torch.__version__}))
        return 1
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    rows: list[dict] = [{"device": name, "torch": torch.__version__,
                         "transformers": transformers.__version__}]  # fmt: skip
    print(json.dumps(rows[0]), flush=True)

    def save() -> None:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_check.json").write_text(json.dumps(rows, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for family in args.families:
                t0 = time.perf_counter()
                try:
                    rows.append(check_family(family, Path(tmp) / dtype, dtype, args.device))
                except Exception as exc:  # one family's failure is a row, not the end of the run
                    rows.append({"family": family, "dtype": dtype, "error": repr(exc)})
                rows[-1]["took_s"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(rows[-1]), flush=True)
                save()
        if args.model:
            path = Path(args.model)
            if args.random_weights:
                path = materialize(path, Path(tmp) / (path.name.lstrip(".") + "-random-weights"))
            for dtype in args.dtypes:
                try:
                    rows.extend(check_model(args, path, dtype))
                    if args.compile_check:
                        rows.append(compile_check(path, dtype, args.device))
                        print(json.dumps(rows[-1]), flush=True)
                except Exception as exc:
                    rows.append({"model": path.name, "dtype": dtype, "error": repr(exc)})
                    print(json.dumps(rows[-1]), flush=True)
                save()
    # exactness is claimed in float32; a bfloat16 suffix over cached KV rounds differently from a
    # full prefill (as any prefix cache's does), so there its agreement is reported, not required
    failed = [
        r for r in rows[1:]
        if r.get("error") or (r.get("equal") is False and r.get("dtype") == "float32")
    ]  # fmt: skip
    print(f"{len(rows) - 1} checks, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
