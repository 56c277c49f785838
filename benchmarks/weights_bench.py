"""``--weights`` on the bundled model: what int8 / int4 linear layers cost in quality and buy in
decode speed, against the model's float32, measured side by side in one run.

Quality (as quant_bench.py measures cache blocks): teacher-forced perplexity of the assistant
turns of tau-bench conversations, each turn's prefix restored from the engine's own cache, and
greedy agreement with float32 (turns identical, tokens before the first divergence). Speed: decode
tok/s over ``--decode`` tokens after the first turn's prompt, the modes interleaved round by
round (medians of ``--repeats``), the load average beside each; with ``--with-concat`` also
float32 on a plain concatenating ``DynamicCache`` (the path a lone request took before).

    .venv/bin/python benchmarks/weights_bench.py \
        --conversation ../shared/data/tau_bench/gpt-4o-airline.json --indices 0,1 --turns 6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from quant_bench import agreement, chat_messages, run_conversation, turns_of  # noqa: E402

MODES = ("model", "int8", "int4")
LABEL = {"model": "model dtype (float32)", "int8": "int8", "int4": "int4"}


def decode_rate(engine: Any, prompt: list[int], num_tokens: int, concat: bool = False) -> float:
    """Greedy tok/s of ``num_tokens`` one-token forwards after ``prompt`` (prefill untimed),
    through the runner's decode path (``concat``: one sequence on a plain ``DynamicCache``)."""
    runner = engine.runner
    state = runner.new_state()
    logits = runner.forward([state], [prompt])[0]
    runner._last_batch = None
    token = int(logits.argmax())
    t0 = time.perf_counter()
    for _ in range(num_tokens):
        if concat:
            logits = runner._forward_one(state, [token])
        else:
            logits = runner.forward([state], [[token]])[0]
        token = int(logits.argmax())
    return num_tokens / (time.perf_counter() - t0)


def max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", required=True, help="tau-bench trajectories (JSON)")
    p.add_argument("--indices", default="0", help="trajectories to score, comma-separated")
    p.add_argument("--turns", type=int, default=6, help="assistant turns per trajectory")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens per turn (agreement)")
    p.add_argument("--decode", type=int, default=256, help="decode tokens timed per run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved speed rounds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: auto)")
    p.add_argument("--with-concat", action="store_true",
                   help="also time float32 on a concatenating DynamicCache (the old lone-request "
                   "path: slow, and its reallocations can take many GB of RAM)")  # fmt: skip
    p.add_argument("--model", default=None, help="model (default: the bundled one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.engines.torch.threads import ThreadTuner
    from promptcache.engines.torch.weights import weights_bytes
    from promptcache.models import resolve_model

    tuner = ThreadTuner(args.threads)
    tuner.apply()
    path = resolve_model(args.model)
    engines = {}
    for mode in MODES:
        model, tokenizer = TorchEngine.load_weights(path, weights=mode)
        engines[mode] = TorchEngine(model, tokenizer, model_id=path.name, ram_budget="1GB")
    with open(args.conversation) as f:
        trajs = json.load(f)
    indices = [int(i) for i in args.indices.split(",")]
    convs = [
        turns_of(engines["model"], chat_messages(trajs[i]["traj"]), args.turns) for i in indices
    ]
    quality: dict[str, dict[str, Any]] = {m: {"nll": 0.0, "tokens": 0, "greedy": []} for m in MODES}
    for mode, engine in engines.items():
        t0 = time.perf_counter()
        for turns in convs:
            res = run_conversation(engine, turns, args.gen)
            q = quality[mode]
            q["nll"] += math.log(res["ppl"]) * res["tokens"]
            q["tokens"] += res["tokens"]
            q["greedy"] += res["greedy"]
        print(f"{LABEL[mode]}: quality {time.perf_counter() - t0:.0f} s, max RSS "
              f"{max_rss_mb():.0f} MB", file=sys.stderr, flush=True)  # fmt: skip
    prompt = convs[0][0][0]
    runs: dict[str, list[float]] = {
        n: [] for n in (*MODES, "concat")[: 4 if args.with_concat else 3]
    }
    loads: list[float] = []
    for r in range(args.repeats):
        for name in runs:
            engine = engines["model" if name == "concat" else name]
            tuner.apply()
            runs[name].append(decode_rate(engine, prompt, args.decode, concat=name == "concat"))
            loads.append(os.getloadavg()[0])
            print(f"round {r} {name}: {runs[name][-1]:.1f} tok/s, load {loads[-1]:.2f}, "
                  f"max RSS {max_rss_mb():.0f} MB", file=sys.stderr, flush=True)  # fmt: skip
    ref = quality["model"]
    rows = []
    for mode in MODES:
        q = quality[mode]
        same, lead = agreement(ref["greedy"], q["greedy"])
        rows.append(
            {
                "weights": LABEL[mode],
                "weights_mb": weights_bytes(engines[mode].model) / 1e6,
                "ppl": math.exp(q["nll"] / q["tokens"]),
                "ppl_vs_f32": math.exp(q["nll"] / q["tokens"]) / math.exp(ref["nll"] / ref["tokens"]) - 1,
                "greedy_turns_same": same,
                "greedy_tokens_lead": lead,
                "decode_tok_s": statistics.median(runs[mode]),
                "decode_runs": runs[mode],
            }
        )  # fmt: skip
    concat = statistics.median(runs["concat"]) if args.with_concat else None
    f32 = rows[0]["decode_tok_s"]
    print(f"\nbundled model {path.name}: trajectories {indices} x {args.turns} turns, "
          f"{ref['tokens']} assistant tokens scored; decode {args.decode} tokens after a "
          f"{len(prompt)}-token prompt, threads {tuner.describe()}, load average "
          f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})\n")  # fmt: skip
    print("| weights | MB | perplexity | vs float32 | greedy turns identical | tokens before divergence | decode tok/s (median) | vs float32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['weights']} | {row['weights_mb']:.0f} | {row['ppl']:.4f} | "
              f"{row['ppl_vs_f32']:+.2%} | {row['greedy_turns_same']:.0%} | "
              f"{row['greedy_tokens_lead']:.0%} | {row['decode_tok_s']:.1f} | "
              f"{row['decode_tok_s'] / f32:.2f}x |")  # fmt: skip
    if concat is not None:
        print(f"| float32, concatenating DynamicCache (before) | | | | | | {concat:.1f} | "
              f"{concat / f32:.2f}x |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "concat": runs.get("concat"),
                                               "loads": loads}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
