"""Quantized cache blocks on the bundled model and a real conversation: what they cost and buy.

For each storage scheme (float32 as the model runs, bfloat16, 8-bit, 4-bit): capacity (blocks
of 64 tokens per GB), perplexity of the model on the conversation's assistant turns with the
cached prefix restored from that scheme's blocks (teacher-forced: restore, prefill the new user /
tool turn, score the assistant's tokens, save them for the next turn), greedy agreement with the
float32 run over the same turns, restore time against float32 blocks and against recomputing the
prefix, and the hit rate of a replayed tau-bench agent trace at equal RAM bytes (capacity in
tokens scaled by the capacity ratio: at equal bytes a scheme holds ratio x as many blocks, and
the replay core counts tokens, so this is exactly the trace at ratio x the token capacity).

    .venv/bin/python benchmarks/quant_bench.py \
        --conversation DATA_DIR/tau_bench/gpt-4o-airline.json --turns 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

SCHEMES: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"cache_dtype": "bfloat16"},
    "8-bit": {"cache_kv_bits": 8},
    "4-bit": {"cache_kv_bits": 4},
}


def chat_messages(traj: list[dict[str, Any]]) -> list[dict[str, str]]:
    """tau-bench messages as plain chat turns: tool calls as their JSON text (the template's)."""
    out = []
    for m in traj:
        text = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]
            text = (
                (text + "\n" if text else "") + "<tool_call>" + json.dumps(calls) + "</tool_call>"
            )
        out.append({"role": m["role"], "content": text})
    return out


def turns_of(
    engine: Any, msgs: list[dict[str, str]], num_turns: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids up to an assistant turn, that turn's ids) for the first ``num_turns`` turns."""
    tok = engine.tokenizer
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        prompt = engine.encode_chat(msgs[:i])
        reply = list(tok.encode(m["content"] + "<|im_end|>", add_special_tokens=False))
        out.append((prompt, reply))
        if len(out) == num_turns:
            break
    return out


@torch.inference_mode()
def run_conversation(
    engine: Any, turns: list[tuple[list[int], list[int]]], gen: int
) -> dict[str, Any]:
    """Teacher-forced NLL of every assistant token and ``gen`` greedy tokens per turn, each turn's
    prefix restored from the cache (its previous turns' blocks)."""
    nll, count, greedy, cached, prefill_s = 0.0, 0, [], [], []
    for prompt, reply in turns:
        t0 = time.perf_counter()
        state, logits, lease, seq = engine.prefill(prompt)
        prefill_s.append(time.perf_counter() - t0)
        cached.append(lease.num_tokens)
        lease.release()
        out, step = [], logits
        for _ in range(gen):  # greedy continuation, then cut back to the prompt
            out.append(int(step.argmax()))
            step = engine.forward(state, [out[-1]])
        greedy.append(out)
        engine.crop(state, len(prompt))
        ids = torch.tensor([reply], device=engine.runner.device)
        later = engine.model(input_ids=ids, past_key_values=state, use_cache=True).logits[0]
        scores = torch.cat([logits.reshape(1, -1), later[:-1]]).float().log_softmax(-1)
        nll -= float(scores[torch.arange(len(reply)), ids[0]].sum())
        count += len(reply)
        # the reply's blocks too: the next turn restores prompt + reply from the cache
        engine.steps.save(seq.extend(reply), state, len(prompt) + len(reply))
    return {
        "ppl": math.exp(nll / count),
        "tokens": count,
        "greedy": greedy,
        "cached": cached,
        "prefill_s": prefill_s,
    }


def restore_seconds(engine: Any, prompt: list[int], repeat: int = 3) -> tuple[float, int]:
    """Best-of-``repeat`` time to rebuild the model state of ``prompt``'s cached prefix."""
    seq = engine.cache.sequence(prompt)
    with engine.cache.lookup(seq) as lease:
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.runner.restore(lease.segments(), lease.checkpoint)
            best = min(best, time.perf_counter() - t0)
        return best, lease.num_tokens


def block_bytes(engine: Any, ids: list[int], block: int = 64) -> int:
    from promptcache.core.block import payload_nbytes

    state = engine.new_state()
    engine.forward(state, ids[:block])
    return payload_nbytes(engine.runner.slice_block(state, 0, block))


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(turns whose greedy tokens are identical, tokens matching before the first divergence)."""
    same = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    lead = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(ref, got, strict=True)
    ]
    return same, sum(lead) / sum(len(a) for a in ref)


def replay_hit_rates(
    tau: str, ratios: dict[str, float], ram_gib: float, per_token: int
) -> dict[str, float]:
    from make_agent_trace import build

    from promptcache.core.replay import read_trace, replay

    with open(tau) as f:
        rows = build([d["traj"] for d in json.load(f)], seed=0, arrival_s=6.0, think_s=30.0)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    base = int(ram_gib * 2**30 / per_token)  # float32 tokens in the RAM budget
    out = {}
    for name, ratio in ratios.items():
        res = replay(list(read_trace(f.name)), int(base * ratio), block_size=64, with_output=True)
        out[name] = res["hit_rate"]
    Path(f.name).unlink()
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", required=True, help="tau-bench trajectories (JSON)")
    p.add_argument("--index", type=int, default=0, help="which trajectory (default 0)")
    p.add_argument("--turns", type=int, default=8, help="assistant turns to score (default 8)")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens per turn (default 16)")
    p.add_argument("--ram-gib", type=float, default=0.25, help="RAM budget of the replay (GiB)")
    p.add_argument("--model", default=None, help="model (default: the bundled one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.models import resolve_model

    path = resolve_model(args.model)
    model, tokenizer = TorchEngine.load_weights(path)
    with open(args.conversation) as f:
        traj = json.load(f)[args.index]["traj"]
    results: dict[str, dict[str, Any]] = {}
    turns: list[tuple[list[int], list[int]]] = []
    for name, opts in SCHEMES.items():
        engine = TorchEngine(model, tokenizer, model_id=path.name, ram_budget="4GB", **opts)
        turns = turns or turns_of(engine, chat_messages(traj), args.turns)
        t0 = time.perf_counter()
        conv = run_conversation(engine, turns, args.gen)
        restore, hit = restore_seconds(engine, turns[-1][0])
        results[name] = {
            **conv,
            "block_bytes": block_bytes(engine, turns[0][0]),
            "restore_s": restore,
            "restore_tokens": hit,
            "seconds": time.perf_counter() - t0,
        }
        print(f"{name}: ppl {conv['ppl']:.4f}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        engine.close()
    full = results["float32"]
    # recomputing the restored prefix, at the first turn's uncached prefill rate (a lower bound:
    # attention over a longer prefix costs more per token); a shared machine times it noisily
    recompute = full["restore_tokens"] * full["prefill_s"][0] / len(turns[0][0])
    ratios = {n: full["block_bytes"] / r["block_bytes"] for n, r in results.items()}
    hits = replay_hit_rates(args.conversation, ratios, args.ram_gib, full["block_bytes"] // 64)
    print(f"\nbundled model {path.name}, tau-bench trajectory {args.index}: {len(turns)} turns, "
          f"{full['tokens']} assistant tokens scored, last prompt {len(turns[-1][0])} tokens "
          f"({full['restore_tokens']} restored); recomputing them: ~{recompute * 1000:.0f} ms")  # fmt: skip
    print("| blocks as | bytes/block | blocks/GB | vs float32 | vs bfloat16 | perplexity | "
          "Δ ppl | greedy turns same | tokens before divergence | restore ms | "
          f"hit rate @ {args.ram_gib:g} GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        same, lead = agreement(full["greedy"], r["greedy"])
        print(f"| {name} | {r['block_bytes']:,} | {1e9 / r['block_bytes']:,.0f} | "
              f"{ratios[name]:.2f}x | {ratios[name] / ratios['bfloat16']:.2f}x | {r['ppl']:.4f} | "
              f"{(r['ppl'] / full['ppl'] - 1) * 100:+.2f}% | {same:.0%} | {lead:.0%} | "
              f"{r['restore_s'] * 1000:.1f} | {hits[name]:.1%} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "hits": hits, "recompute_s": recompute})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
