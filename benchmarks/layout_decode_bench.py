"""Decode of N requests at once on a model whose layers do not all grow (sliding windows, SSM
or linear-attention state beside full attention): batched steps against one sequence per
forward (how torch decoded such models before their steps batched).

Builds a random-weight model the bundled model's size (30 layers, hidden 576, 9 heads / 3 KV
heads) of ``--family``: ``gemma3`` (a 512-token window on five layers of six), ``bamba`` (Mamba2
layers, attention on every sixth) or ``qwen3_5`` (gated delta net layers, attention on every
fourth). It loads it in the torch engine (cache off, no HTTP) and runs ``--sessions`` requests
at once, each a prompt of its own of ``--context`` tokens and ``--decode`` tokens out (greedy,
``ignore_eos``). ``--modes`` alternate over ``--runs``: ``batched`` (the engine as it is),
``one_by_one`` (the runner's decode batching off for the run) and ``model_step`` (batched,
through the model's own forward rather than the lean step, where the model has one:
``torch.lean``). Prints each run's aggregate
decode tokens/s (tokens after each request's first / the time from the last first token to the
last token) and checks that both modes give the same tokens.

    .venv/bin/python benchmarks/layout_decode_bench.py --family gemma3 --sessions 8 --context 1500 --runs 2
    .venv/bin/python benchmarks/layout_decode_bench.py --family bamba --sessions 8 --context 500 --runs 2
    .venv/bin/python benchmarks/layout_decode_bench.py --family gemma3 --modes batched model_step
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


SIZE: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, max_position_embeddings=8192, initializer_range=0.2)  # fmt: skip
FAMILIES = ("gemma3", "bamba", "qwen3_5")


def family_config(family: str) -> Any:
    from transformers import AutoConfig

    layers = SIZE["num_hidden_layers"]
    if family == "gemma3":
        return AutoConfig.for_model("gemma3_text", **SIZE, sliding_window=512)
    if family == "bamba":
        attention = [i for i in range(layers) if i % 6 == 5]
        return AutoConfig.for_model("bamba", **SIZE, attn_layer_indices=attention,
                                    mamba_n_heads=18, mamba_d_head=64, mamba_d_state=64,
                                    mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=64)  # fmt: skip
    if family == "qwen3_5":
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        return AutoConfig.for_model("qwen3_5_text", **SIZE, layer_types=kinds,
                                    linear_conv_kernel_dim=4, linear_key_head_dim=64,
                                    linear_value_head_dim=64, linear_num_key_heads=4,
                                    linear_num_value_heads=8)  # fmt: skip
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def build_engine(family: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_models import ByteTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    return TorchEngine(model, ByteTokenizer(), cache_enabled=False)


MODES = ("batched", "one_by_one", "model_step")


def run(engine: Any, prompts: list[list[int]], decode: int, mode: str) -> dict[str, Any]:
    from promptcache.engines.base import Finished, PrefillDone, SamplingParams
    from promptcache.engines.torch.batch import can_batch

    runner = engine.runner
    lean = runner.__dict__.setdefault("bench_lean", runner._decoder)
    runner._batches = mode != "one_by_one" and can_batch(runner.layout)
    runner._decoder = runner.model if mode == "model_step" else lean  # the model's forward
    runner.reset_decode()
    firsts: list[float] = []
    lasts: list[float] = []
    tokens: list[list[int]] = [[] for _ in prompts]

    def one(k: int) -> None:
        params = SamplingParams(max_tokens=decode, ignore_eos=True)
        for ev in engine.generate(prompts[k], params):
            if isinstance(ev, PrefillDone):  # the first token is sampled with it
                firsts.append(time.perf_counter())
            if isinstance(ev, Finished):
                tokens[k] = list(ev.completion_ids)
        lasts.append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(lasts) - max(firsts)
    after_first = sum(len(t) - 1 for t in tokens)
    return {
        "mode": mode,
        "decode_tok_s": round(after_first / span, 1) if span > 0 else None,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="gemma3")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["batched", "one_by_one"])
    args = ap.parse_args()
    engine = build_engine(args.family)
    print("layout:", engine.runner.layout.kinds[:6], "...", flush=True)
    rng = random.Random(1)
    prompts = [
        [rng.randrange(300, 49000) for _ in range(args.context)] for _ in range(args.sessions)
    ]
    rates: dict[str, list[float]] = {m: [] for m in args.modes}
    seen: dict[str, list[list[int]]] = {}
    for i in range(args.runs):
        for mode in args.modes if i % 2 == 0 else args.modes[::-1]:
            row = run(engine, prompts, args.decode, mode)
            toks = row.pop("tokens")
            seen.setdefault(row["mode"], toks)
            rates[row["mode"]].append(row["decode_tok_s"])
            print(json.dumps(row), flush=True)
    print(json.dumps({
        "family": args.family, "sessions": args.sessions, "context": args.context,
        "median_tok_s": {m: round(statistics.median(v), 1) for m, v in rates.items()},
        "same_tokens": all(t == seen[args.modes[0]] for t in seen.values()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
