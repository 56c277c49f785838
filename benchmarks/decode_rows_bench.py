"""Decode steps of many requests at once: the padded batch (``torch/batch.py``) against ragged
rows (``torch/ragged.py``), on the bundled model's lean step, with requests joining and leaving
as they do under many agent sessions.

N rows with contexts of ``--min-context``..``--max-context`` positions (random keys/values: a
decode step's cost does not depend on them) decode ``--steps`` steps; every ``--churn`` steps
one row leaves and a new one joins (``0``: the same rows throughout). Both ways run the same
schedule, interleaved by repeat; medians of the per-step times.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_rows_bench.py --rows 1 4 16 32 --churn 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from promptcache.engines.torch.batch import batched_decode  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.lean import LeanDecoder  # noqa: E402
from promptcache.engines.torch.ragged import ragged_decode, use_row_layers  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402
from promptcache.models import resolve_model  # noqa: E402


def random_state(model: object, length: int, gen: torch.Generator, rows: bool) -> DynamicCache:
    config = model.config  # type: ignore[attr-defined]
    text = config.get_text_config()
    kv, dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    state = DynamicCache(config=config)
    if rows:  # the runner's own states on the lean step: layers that grow in place
        use_row_layers(state)
    noise = torch.randn((1, kv, length, dim), generator=gen) * 0.1  # one draw, every layer
    for i in range(text.num_hidden_layers):
        state.update(noise + i * 0.01, noise - i * 0.01, i)
    return state


def run(
    way: str, runner: TorchRunner, rows: int, args: argparse.Namespace, seed: int
) -> list[float]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    decoder = runner._decoder
    assert isinstance(decoder, LeanDecoder), "the bundled model decodes with the lean step"

    def fresh() -> DynamicCache:
        return random_state(
            runner.model, rng.randint(args.min_context, args.max_context), gen, way == "ragged"
        )

    states = [fresh() for _ in range(rows)]
    kept = None
    times = []
    with torch.inference_mode():
        for step in range(args.steps):
            if args.churn and step and step % args.churn == 0:
                states[rng.randrange(rows)] = fresh()  # one leaves, another joins
            tokens = [rng.randrange(1000) for _ in states]
            t0 = time.perf_counter()
            if way == "padded":
                _, kept = batched_decode(decoder, runner._cache_arg, states, tokens, kept)
            else:
                ragged_decode(decoder, states, tokens)
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--churn", type=int, default=2, help="steps between a leave + join (0: none)")
    p.add_argument("--min-context", type=int, default=1000)
    p.add_argument("--max-context", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    args = p.parse_args()
    model, tokenizer = TorchEngine.load_weights(str(resolve_model(args.model)))
    runner = TorchRunner(model, tokenizer)
    warm = argparse.Namespace(**{**vars(args), "steps": 3, "min_context": 64, "max_context": 64})
    for rows in args.rows:  # oneDNN makes its kernels per shape on first use: not timed
        run("padded", runner, rows, warm, seed=99), run("ragged", runner, rows, warm, seed=99)
    print("| rows | churn | padded ms/step (mean / median) | ragged ms/step (mean / median) "
          "| ragged / padded (mean) |\n|---|---|---|---|---|")  # fmt: skip
    for rows in args.rows:
        got: dict[str, list[float]] = {"padded": [], "ragged": []}
        for rep in range(args.repeats):
            for way in ("padded", "ragged") if rep % 2 == 0 else ("ragged", "padded"):
                got[way] += run(way, runner, rows, args, seed=rep)[1:]  # the first: a gather
        pad, rag = statistics.mean(got["padded"]), statistics.mean(got["ragged"])
        pad_m, rag_m = statistics.median(got["padded"]), statistics.median(got["ragged"])
        print(f"| {rows} | {args.churn} | {pad * 1e3:.1f} / {pad_m * 1e3:.1f} | "
              f"{rag * 1e3:.1f} / {rag_m * 1e3:.1f} | {rag / pad:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
