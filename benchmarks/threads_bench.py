"""When to give a core up: one engine step at 1 and at 2 torch threads while another process
keeps part of one core busy (the thread tuner's ``SLACK``, ``engines/torch/threads.py``).

A burner process spins ``duty`` of every 10 ms. The steps are those of many sessions at once
on the bundled model's lean step: a ragged decode of ``--rows`` rows, and the same rows packed
with one prefill piece of ``--piece`` tokens, every context ``--context`` positions (random
keys/values). Medians of ``--repeats`` steps per cell, the two thread counts side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/threads_bench.py --duty 0 0.3 0.5 0.7 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
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
from promptcache.engines.torch.ragged import packed_forward, ragged_decode  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402
from promptcache.models import resolve_model  # noqa: E402


def burn(duty: float, stop: mp.synchronize.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.01 * duty:
            pass
        time.sleep(0.01 * (1 - duty) + 1e-6)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duty", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 1.0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--piece", type=int, default=360)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    args = p.parse_args()
    model, tokenizer = TorchEngine.load_weights(str(resolve_model(args.model)))
    runner = TorchRunner(model, tokenizer)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)

    def step(packed: bool) -> float:
        states = [random_state(runner.model, args.context, gen, True) for _ in range(args.rows)]
        ids = [[rng.randrange(1000)] for _ in range(args.rows)]
        if packed:
            states.append(random_state(runner.model, args.context, gen, True))
            ids.append([rng.randrange(1000) for _ in range(args.piece)])
        t0 = time.perf_counter()
        with torch.inference_mode():
            if packed:
                packed_forward(runner._decoder, states, ids, torch.device("cpu"))
            else:
                ragged_decode(runner._decoder, states, [x[0] for x in ids])
        return time.perf_counter() - t0

    print(f"| other process's duty | decode {args.rows} rows: 1 / 2 threads | "
          f"+ a {args.piece}-token piece: 1 / 2 threads |\n|---|---|---|")  # fmt: skip
    for duty in args.duty:
        stop = mp.Event()
        burner = mp.Process(target=burn, args=(duty, stop)) if duty > 0 else None
        if burner:
            burner.start()
        cells = []
        for packed in (False, True):
            ms = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                step(packed)  # warm
                ms.append(statistics.median(step(packed) for _ in range(args.repeats)) * 1e3)
            cells.append(f"{ms[0]:.0f} / {ms[1]:.0f} ms ({ms[0] / ms[1]:.2f}x)")
        stop.set()
        if burner:
            burner.join()
        print(f"| {duty:.1f} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
