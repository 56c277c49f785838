"""The GPU path in one prepared run (``--device cuda``), for a session that has a GPU machine.

Nothing can be downloaded there, so everything it needs travels with the checkout or is built
here: tiny random-weight models of several families (``promptcache.testing``) are saved to a
folder and served on CUDA through ``TorchEngine.load(..., device="cuda")``. For each one it
checks that greedy replies with the cache on equal those with it off over a multi-turn
conversation, that later turns hit the cache, and that concurrent requests decode in shared
forwards; then it times decode on CUDA. ``--model DIR`` adds a real model folder (the bundled
model's float32/bfloat16 folder, carried there) with TTFT per turn, cache on vs off.

    python benchmarks/gpu_check.py --out OUT_DIR [--model DIR] [--dtype bfloat16]

Prints one JSON line per check and a summary; exits 1 when any equality check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = (
    "llama",
    "qwen3",
    "gemma3",
    "qwen3_next",
    "nemotron_h",
)  # attention, sliding, SSM hybrids


def conversation(engine, turns: int, dtype_note: str) -> dict:  # noqa: ANN001
    from promptcache.engines.base import SamplingParams

    prompt: list[int] = list(range(5, 90))
    out = {"ttft_s": [], "cached": [], "replies": []}
    for turn in range(turns):
        t0 = time.perf_counter()
        fin = None
        for ev in engine.generate(prompt, SamplingParams(max_tokens=16)):
            fin = ev
        out["ttft_s"].append(round(time.perf_counter() - t0, 4))
        out["cached"].append(fin.cached_tokens)
        out["replies"].append(fin.completion_ids)
        prompt = prompt + fin.completion_ids + [7 + turn] * 20
    out["note"] = dtype_note
    return out


def check_family(family: str, root: Path, dtype: str, device: str) -> dict:
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_families import save_family

    path = save_family(family, root / family)
    on = TorchEngine.load(path, device=device, dtype=dtype, block_size=16)
    off = TorchEngine.load(path, device=device, dtype=dtype, block_size=16, cache_enabled=False)
    a, b = conversation(on, 4, dtype), conversation(off, 4, dtype)
    together: list = [None] * 4
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, conversation(on, 1, "")))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = on.cache_stats()
    return {
        "family": family, "equal": a["replies"] == b["replies"], "cached_per_turn": a["cached"],
        "hits_after_first": all(c > 0 for c in a["cached"][1:]),
        "max_batch_rows": stats.get("max_batch_rows"), "ttft_on_s": a["ttft_s"], "ttft_off_s": b["ttft_s"],
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None)
    p.add_argument("--model", help="a real model folder carried to the machine")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda", help="cpu: try the script itself anywhere")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "torch": torch.__version__}))
        return 1
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    rows: list[dict] = [{"device": name, "torch": torch.__version__}]
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            try:
                rows.append(check_family(family, Path(tmp), args.dtype, args.device))
            except Exception as exc:  # one family's failure is a row, not the end of the run
                rows.append({"family": family, "error": repr(exc)})
            print(json.dumps(rows[-1]), flush=True)
    if args.model:
        from promptcache.engines.torch.engine import TorchEngine

        on = TorchEngine.load(args.model, device=args.device, dtype=args.dtype)
        off = TorchEngine.load(
            args.model, device=args.device, dtype=args.dtype, cache_enabled=False
        )
        a, b = conversation(on, 6, args.dtype), conversation(off, 6, args.dtype)
        rows.append({"model": args.model, "equal": a["replies"] == b["replies"],
                     "ttft_on_s": a["ttft_s"], "ttft_off_s": b["ttft_s"], "cached": a["cached"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows[1:] if r.get("error") or r.get("equal") is False]
    print(f"{len(rows) - 1} checks, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
