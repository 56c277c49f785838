"""Reuse on an agent loop: models with snapshot layers (sliding window, SSM) vs attention.

Each model runs the same loop on tiny random-weight models (``testing/tiny_models.py``): a
shared system prompt and task, then turns of reply + tool result, and a regenerate (the same
prompt again) every third turn. Reuse is cached / prompt tokens over every request after the
first. ``exact`` turns extend the previous prompt + reply token for token (what the server's
chat formatting does when a reply re-renders as generated); ``retemplated`` turns drop the
reply's last two tokens (a template that trims the end of a reply), so a hybrid falls back to
its nearest checkpoint while attention reuses up to the first changed token. ``before`` is the
same run without the checkpoint at the prompt's last computed position.

Run: .venv/bin/python benchmarks/hybrid_reuse_bench.py            # torch models
     .venv/bin/python benchmarks/hybrid_reuse_bench.py --mlx      # and the MLX ones
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from promptcache.engines.base import SamplingParams
from promptcache.testing.tiny_models import ByteTokenizer

TORCH_KINDS = ("llama", "gemma3", "jamba", "bamba", "mamba")
MLX_KINDS = ("llama", "gemma3", "mamba2", "falcon_h1")
ATTENTION = "llama"


def make_engine(backend: str, kind: str, block: int, chunk: int) -> Any:
    kw = dict(block_size=block, ram_budget=10**9, prefill_chunk=chunk)
    if backend == "torch":
        from promptcache.engines.torch.engine import TorchEngine
        from promptcache.testing.tiny_models import tiny_model

        return TorchEngine(tiny_model(kind), ByteTokenizer(), **kw)
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import mlx_tiny_model

    return MlxEngine(mlx_tiny_model(kind), ByteTokenizer(), **kw)


def agent_loop(engine: Any, mode: str, turns: int, seed: int = 0) -> tuple[int, int]:
    """(cached, prompt) tokens over every request after the first."""
    rng = random.Random(seed)
    history = [rng.randrange(3, 256) for _ in range(rng.randrange(250, 350))]
    params = SamplingParams(max_tokens=16)
    cached = total = 0
    for turn in range(turns):
        for again in range(2 if turn % 3 == 2 else 1):  # every third turn: a regenerate too
            events = list(engine.generate(history, params))
            if turn or again:
                cached += events[-1].cached_tokens
                total += events[-1].prompt_tokens
        reply = events[-1].completion_ids
        if mode == "retemplated":
            reply = reply[:-2]
        history = history + reply + [rng.randrange(3, 256) for _ in range(rng.randrange(30, 90))]
    return cached, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mlx", action="store_true", help="also the MLX tiny models")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    runs = [("torch", k) for k in TORCH_KINDS] + (
        [("mlx", k) for k in MLX_KINDS] if args.mlx else []
    )
    rows: list[dict[str, Any]] = []
    print("| engine | model | loop | reuse | vs attention | before | before vs attention |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode in ("exact", "retemplated"):
        base: dict[str, float] = {}
        for backend, kind in runs:
            row: dict[str, Any] = {"engine": backend, "model": kind, "loop": mode}
            for label, last in (("reuse", True), ("before", False)):
                engine = make_engine(backend, kind, args.block, args.chunk)
                engine.steps.checkpoint_last = last
                c, t = agent_loop(engine, mode, args.turns)
                engine.cache.check_integrity()
                engine.close()
                row[label] = c / t
            if kind == ATTENTION:
                base[backend] = row["reuse"]
            ref = base.get(backend)
            row["vs_attention"] = row["reuse"] / ref if ref else None
            row["before_vs_attention"] = row["before"] / ref if ref else None
            rows.append(row)
            print(
                f"| {backend} | {kind} | {mode} | {row['reuse']:.3f} | {row['vs_attention']:.3f} |"
                f" {row['before']:.3f} | {row['before_vs_attention']:.3f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
