"""``--weights`` on the bundled model: what int8 / int4 linear layers cost in quality and buy in
decode speed, against the model's float32, measured side by side in one run.

Quality (as quant_bench.py measures cache blocks): teacher-forced perplexity of the assistant
turns of tau-bench conversations, each turn's prefix restored from the engine's own cache, and
greedy agreement with float32 (turns identical, tokens before the first divergence). Speed: decode
tok/s of one request generating ``--decode`` tokens through the engine (scheduler, sampling,
text stream: all but HTTP) after a short chat prompt (peer_bench's decode request), the modes
interleaved round by round (medians of ``--repeats``), the load average and the RSS growth per
token beside each; ``--compile MODES`` adds those modes with the compiled decode step (its
compile time reported: minutes per mode on a small CPU); ``--peers`` prints the peers' decode
figures of a peer_bench JSON beside; ``--with-concat`` adds float32 on a concatenating
``DynamicCache`` (the old lone path).

    .venv/bin/python benchmarks/weights_bench.py \
        --conversation DATA_DIR/tau_bench/gpt-4o-airline.json --indices 0,1 --turns 6
    .venv/bin/python benchmarks/weights_bench.py --speed-only --modes model,int8,int4 \
        --compile model,int4 --peers PEERS.json
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
LABEL = {"model": "float32", "int8": "int8", "int4": "int4"}
DECODE_PROMPT = "Write a long, detailed story about a day in the life of an airline agent."


def rss_mb() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        return 0.0


def decode_rate(
    engine: Any, prompt: list[int], num_tokens: int, concat: bool = False
) -> tuple[float, int, float]:
    """(tok/s after the first token, tokens, RSS growth MB per token) of one greedy request of
    ``num_tokens`` through ``engine.generate``; ``concat``: one-token forwards of the runner on a
    plain concatenating ``DynamicCache`` instead (the old lone path; no engine around it)."""
    from promptcache.engines.base import Finished, PrefillDone, SamplingParams

    engine.runner.reset_decode()
    rss0 = rss_mb()
    if concat:
        runner = engine.runner
        state = runner.new_state()
        token = int(runner.forward([state], [prompt])[0].argmax())
        t0 = time.perf_counter()
        for _ in range(num_tokens - 1):
            token = int(runner._forward_one(state, [token]).argmax())
        n, dt = num_tokens, time.perf_counter() - t0
    else:
        t0, n = 0.0, 0
        for ev in engine.generate(prompt, SamplingParams(max_tokens=num_tokens)):
            if isinstance(ev, PrefillDone):
                t0 = time.perf_counter()
            elif isinstance(ev, Finished):
                n = ev.completion_tokens
        dt = time.perf_counter() - t0
    return (n - 1) / dt, n, (rss_mb() - rss0) / n


def max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peer_decode(path: str) -> dict[str, tuple[float, float]]:
    """server -> (median decode tok/s, median load) of a peer_bench ``--out`` JSON."""
    results = json.loads(Path(path).read_text())["results"]
    out = {}
    for name, runs in results.items():
        rows = [r for run in runs for r in run if r["turn"] == "decode" and r.get("decode_tok_s")]
        if rows:
            rates, loads = [r["decode_tok_s"] for r in rows], [r["load"] for r in rows]
            out[name] = (statistics.median(rates), statistics.median(loads))
    return out


def quality_rows(args: argparse.Namespace, engines: dict[str, Any]) -> dict[str, dict[str, Any]]:
    with open(args.conversation) as f:
        trajs = json.load(f)
    indices = [int(i) for i in args.indices.split(",")]
    ref_engine = engines[MODES[0]] if MODES[0] in engines else next(iter(engines.values()))
    convs = [turns_of(ref_engine, chat_messages(trajs[i]["traj"]), args.turns) for i in indices]
    quality: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        q = quality[name] = {"nll": 0.0, "tokens": 0, "greedy": []}
        t0 = time.perf_counter()
        for turns in convs:
            res = run_conversation(engine, turns, args.gen)
            q["nll"] += math.log(res["ppl"]) * res["tokens"]
            q["tokens"] += res["tokens"]
            q["greedy"] += res["greedy"]
        print(f"{name}: quality {time.perf_counter() - t0:.0f} s, max RSS {max_rss_mb():.0f} MB",
              file=sys.stderr, flush=True)  # fmt: skip
    print(f"quality: trajectories {indices} x {args.turns} turns, "
          f"{quality[next(iter(quality))]['tokens']} assistant tokens scored", flush=True)  # fmt: skip
    return quality


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", default=None, help="tau-bench trajectories (JSON)")
    p.add_argument("--indices", default="0", help="trajectories to score, comma-separated")
    p.add_argument("--turns", type=int, default=6, help="assistant turns per trajectory")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens per turn (agreement)")
    p.add_argument("--speed-only", action="store_true", help="skip the quality part")
    p.add_argument("--modes", default=",".join(MODES), help="weights modes to run")
    p.add_argument("--compile", default="", help="modes to run with --compile too, e.g. model,int4")
    p.add_argument("--decode", type=int, default=256, help="decode tokens timed per run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved speed rounds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: auto)")
    p.add_argument("--with-concat", action="store_true",
                   help="also time float32 on a concatenating DynamicCache (the old lone-request "
                   "path: slow, and its reallocations can take many GB of RAM)")  # fmt: skip
    p.add_argument("--peers", default=None, help="a peer_bench JSON: its decode figures beside")
    p.add_argument("--model", default=None, help="model (default: the bundled one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not args.speed_only and not args.conversation:
        raise SystemExit("--conversation is needed for the quality part (or --speed-only)")

    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.engines.torch.threads import ThreadTuner, hold_one_thread
    from promptcache.engines.torch.weights import weights_bytes
    from promptcache.models import resolve_model

    tuner = ThreadTuner(args.threads)
    hold_one_thread()  # engine.generate steps on its own thread, at the tuner's count
    path = resolve_model(args.model)
    engines: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    for mode in args.modes.split(","):
        for compiled in (False, True) if mode in args.compile.split(",") else (False,):
            name = LABEL[mode] + (" +compile" if compiled else "")
            model, tokenizer = TorchEngine.load_weights(path, weights=mode)
            engines[name] = engine = TorchEngine(
                model, tokenizer, model_id=path.name, ram_budget="1GB", threads=tuner,
                compile=compiled,
            )  # fmt: skip
            if compiled:
                compile_s[name] = engine.compile_s
                print(f"{name}: compiled in {engine.compile_s:.0f} s", file=sys.stderr, flush=True)
    quality = None if args.speed_only else quality_rows(args, engines)
    first = next(iter(engines.values()))
    prompt = first.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    names = [*engines, *(["float32 concat (old lone path)"] if args.with_concat else [])]
    runs: dict[str, list[tuple[float, int, float]]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            concat = name.startswith("float32 concat")
            engine = engines["float32"] if concat else engines[name]
            runs[name].append(decode_rate(engine, prompt, args.decode, concat=concat))
            loads[name].append(os.getloadavg()[0])
            rate, n, growth = runs[name][-1]
            print(f"round {r} {name}: {rate:.1f} tok/s over {n} tokens, load {loads[name][-1]:.2f},"
                  f" RSS {growth:+.2f} MB/token, max RSS {max_rss_mb():.0f} MB",
                  file=sys.stderr, flush=True)  # fmt: skip
    peers = peer_decode(args.peers) if args.peers else {}
    rows = []
    for name in names:
        engine = engines["float32" if name not in engines else name]
        row: dict[str, Any] = {
            "weights": name,
            "weights_mb": weights_bytes(engine.model) / 1e6,
            "decode_tok_s": statistics.median(x[0] for x in runs[name]),
            "decode_runs": [x[0] for x in runs[name]],
            "load": statistics.median(loads[name]),
            "rss_mb_per_token": statistics.median(x[2] for x in runs[name]),
            "compile_s": compile_s.get(name),
        }
        if quality is not None and name in quality:
            ref, q = quality[next(iter(quality))], quality[name]
            same, lead = agreement(ref["greedy"], q["greedy"])
            ref_ppl = math.exp(ref["nll"] / ref["tokens"])
            row.update(ppl=math.exp(q["nll"] / q["tokens"]), greedy_turns_same=same,
                       greedy_tokens_lead=lead)  # fmt: skip
            row["ppl_vs_first"] = row["ppl"] / ref_ppl - 1
        rows.append(row)
    base = rows[0]["decode_tok_s"]
    print(f"\nbundled model {path.name}: decode {args.decode} tokens after a {len(prompt)}-token "
          f"chat prompt through engine.generate, threads {tuner.describe()}, medians of "
          f"{args.repeats} interleaved rounds\n")  # fmt: skip
    print("| weights | MB | perplexity | vs first | greedy turns same | tokens before divergence "
          "| decode tok/s [load] | vs first | RSS MB/token | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        qcols = (f"{row['ppl']:.4f} | {row['ppl_vs_first']:+.2%} | {row['greedy_turns_same']:.0%} | "
                 f"{row['greedy_tokens_lead']:.0%}" if "ppl" in row else "- | - | - | -")  # fmt: skip
        comp = f"{row['compile_s']:.0f}" if row["compile_s"] is not None else "-"
        print(f"| {row['weights']} | {row['weights_mb']:.0f} | {qcols} | "
              f"{row['decode_tok_s']:.1f} [{row['load']:.1f}] | {row['decode_tok_s'] / base:.2f}x | "
              f"{row['rss_mb_per_token']:+.2f} | {comp} |")  # fmt: skip
    if peers:
        print(f"\npeers' decode ({args.peers}, over HTTP; medians [load]): " + ", ".join(
            f"{n} {rate:.1f} tok/s [{load:.1f}]" for n, (rate, load) in peers.items()))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peers": peers}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
