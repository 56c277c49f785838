"""Images and the caches on the MLX engine: ``vlm_bench``'s 4-turn, two-image conversation on
the small random-weight llava built offline for mlx-vlm, prompt cache on, off, and on without
the vision-embedding cache (TTFT medians per turn, encoder runs, speed-ups vs cache off).

Run: PYTHONPATH=. .venv/bin/python benchmarks/mlx_vlm_bench.py [--size small] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mlx.utils import tree_flatten
from vlm_bench import MODES, _timed, picture, run_conversation

from promptcache.engines.mlx.vlm_engine import MlxVlmEngine
from promptcache.testing.mlx_tiny_vlm import MLX_SIZES, mlx_tiny_vlm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="small", choices=list(MLX_SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, processor = mlx_tiny_vlm(seed=0, size=args.size)
    a, b = picture(1, 480, 640), picture(2, 600, 400)
    t0 = time.perf_counter()
    probe = MlxVlmEngine(model, processor, cache_enabled=False)
    vision = probe.runner.vision
    vision.encode(a)  # warm-up, and the encoder's cost alone
    encoder_s = min(_timed(lambda: vision.encode(a)) for _ in range(3))
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    encoder_runs: dict[str, int] = {}
    tokens_on: dict[int, tuple] = {}  # turn -> (prompt tokens, cached tokens) with the cache on
    names = list(MODES)
    for rep in range(args.reps):
        engines = {m: MlxVlmEngine(model, processor, block_size=64, ram_budget="2GB", **MODES[m])
                   for m in names}  # fmt: skip
        convs = {m: run_conversation(engines[m], a, b) for m in names}  # type: ignore[arg-type]
        runs: dict[str, list[float]] = {m: [] for m in names}
        for turn in range(4):  # modes interleaved per turn (rotated per rep): noise hits alike
            for m in names[rep % 3 :] + names[: rep % 3]:
                step = next(convs[m])  # vlm_bench yields (ttft, prompt tokens, cached tokens)
                runs[m].append(step[0] if isinstance(step, tuple) else step)
                if isinstance(step, tuple) and m == "cache on":
                    tokens_on[turn] = step[1:]
        for m in names:
            results[m].append(runs[m])
            feeder = engines[m].feeder
            encoder_runs[m] = feeder.num_encoder_runs if feeder else 0
            engines[m].close()
    medians = {m: [statistics.median(r[t] for r in runs) for t in range(4)]
               for m, runs in results.items()}  # fmt: skip
    tokens = vision.num_tokens(a)
    params = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    print(f"mlx-vlm llava {args.size}: {params:.1f}M params, {tokens} tokens per image, "
          f"encoder {encoder_s * 1e3:.0f} ms per image, {args.reps} reps "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"{'turn':<6}" + "".join(f"{m:>22}" for m in MODES))
    for t in range(4):
        print(f"{t + 1:<6}" + "".join(f"{medians[m][t] * 1e3:>19.0f} ms" for m in MODES))
    if tokens_on:
        print("cache on, prompt/cached tokens per turn: "
              + ", ".join(f"{p}/{c}" for p, c in (tokens_on[t] for t in range(4))))  # fmt: skip
    print("encoder runs in the last rep: " + ", ".join(f"{m} {n}" for m, n in encoder_runs.items()))
    off = medians["cache off"]
    for m in ("cache on", "embedding cache off"):
        ratios = ", ".join(f"{off[t] / medians[m][t]:.1f}x" for t in range(4))
        print(f"speed-up vs cache off ({m}): {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": "mlx-vlm", "size": args.size, "reps": args.reps,
                       "tokens_per_image": tokens, "encoder_s": encoder_s,
                       "ttft_s_median": medians, "ttft_s_runs": results,
                       "encoder_runs_last_rep": encoder_runs}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
