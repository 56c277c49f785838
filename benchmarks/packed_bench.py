"""One engine step under many sessions: prefill pieces of several requests beside decode rows,
as separate forwards (each piece through the model's forward, then one ragged decode forward
over the decode rows: the step before ``PackedRunner``) against one packed forward
(``TorchRunner.forward_packed``), on the bundled model.

Each step: ``--decode`` rows decoding one token each and P pieces of K tokens (every pair of
``--pieces`` x ``--piece-tokens``) on top of contexts of ``--min-context``..``--max-context``
positions (random keys/values: a step's cost does not depend on them). Both ways run the same
states and tokens, interleaved by repeat; medians of the per-step times.

    PYTHONPATH=. .venv/bin/python benchmarks/packed_bench.py --decode 12 --pieces 2 4 8 \
        --piece-tokens 32 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from decode_rows_bench import random_state  # noqa: E402

from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402
from promptcache.models import resolve_model  # noqa: E402


def run(
    way: str, runner: TorchRunner, pieces: int, tokens: int, args: argparse.Namespace, seed: int
) -> list[float]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)

    def fresh() -> object:
        length = rng.randint(args.min_context, args.max_context)
        return random_state(runner.model, length, gen, rows=True)

    rows = [fresh() for _ in range(args.decode)]
    times = []
    with torch.inference_mode():
        for _ in range(args.steps):
            prefilling = [fresh() for _ in range(pieces)]  # pieces of other prompts each step
            ids = [[rng.randrange(1000) for _ in range(tokens)] for _ in prefilling]
            decode = [[rng.randrange(1000)] for _ in rows]
            t0 = time.perf_counter()
            if way == "separate":
                for state, piece in zip(prefilling, ids, strict=True):
                    runner.forward([state], [piece])
                if rows:
                    runner.forward(rows, decode)
            else:
                runner.forward_packed([*prefilling, *rows], [*ids, *decode])
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--decode", type=int, default=12, help="decode rows in every step")
    p.add_argument("--pieces", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--piece-tokens", type=int, nargs="+", default=[32, 256])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--min-context", type=int, default=1000)
    p.add_argument("--max-context", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    args = p.parse_args()
    if args.threads:  # on a shared machine one thread is steadier (no team waiting at barriers)
        torch.set_num_threads(args.threads)
    model, tokenizer = TorchEngine.load_weights(str(resolve_model(args.model)))
    runner = TorchRunner(model, tokenizer)
    assert runner.packs([]), "the bundled model runs the lean step"
    warm = argparse.Namespace(**{**vars(args), "steps": 1, "min_context": 64, "max_context": 64})
    for pieces in args.pieces:  # oneDNN makes its kernels per shape on first use: not timed
        for tokens in args.piece_tokens:
            run("separate", runner, pieces, tokens, warm, 99)
            run("packed", runner, pieces, tokens, warm, 99)
    print(f"decode rows: {args.decode}, contexts {args.min_context}-{args.max_context}")
    print("| pieces x tokens | separate ms/step (median) | packed ms/step (median) "
          "| packed / separate |\n|---|---|---|---|")  # fmt: skip
    for pieces in args.pieces:
        for tokens in args.piece_tokens:
            got: dict[str, list[float]] = {"separate": [], "packed": []}
            for rep in range(args.repeats):
                ways = ("separate", "packed") if rep % 2 == 0 else ("packed", "separate")
                for way in ways:
                    got[way] += run(way, runner, pieces, tokens, args, seed=rep)
            sep, pack = statistics.median(got["separate"]), statistics.median(got["packed"])
            print(f"| {pieces} x {tokens} | {sep * 1e3:.0f} | {pack * 1e3:.0f} | "
                  f"{pack / sep:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
