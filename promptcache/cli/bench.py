"""`promptcache bench`: multi-turn TTFT with the cache on, off, and the in-memory ideal.

Per turn, in the same process and interleaved (so machine noise hits all modes alike):
- on: the engine with the prompt cache, generating the reply the client appends;
- off: the same model, cache off, prefilling the same prompt;
- ideal: the previous turn's KV (prompt + reply) kept live, cropped to the common prefix and
  only the new tokens prefilled: what a perfect single-session cache could do.
Medians over --repeats runs (fresh caches each run). Writes bench.json and ttft.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = (
    "You are an airline customer-service agent. Follow the policy strictly. "
    "Before any action that changes a booking, list the details and get explicit confirmation. "
    "Only one tool call at a time; never make up information; transfer to a human when the request is out of scope. "
)


def synthetic_conversation(turns: int) -> list[dict[str, Any]]:
    """A long system prompt, then user and tool turns of a few hundred tokens each."""
    policy = "\n".join(f"Rule {i}: {SYSTEM_PROMPT}" for i in range(24))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": policy}]
    for t in range(turns):
        if t % 2 == 0:
            body = (
                f"Turn {t}: I need to change reservation R{t:04d}. "
                + "My itinerary has these legs: "
                + ", ".join(
                    f"flight HAT{100 + i} from city {i} to city {i + 1} on May {10 + i}"
                    for i in range(12)
                )
            )
            msgs.append({"role": "user", "content": body})
        else:
            rows = [
                {
                    "flight": f"HAT{200 + i}",
                    "seats": {"economy": i, "business": 2 * i},
                    "price": 100 + 7 * i,
                }
                for i in range(10)
            ]
            msgs.append({"role": "tool", "content": json.dumps({"turn": t, "results": rows})})
        msgs.append({"role": "assistant", "content": None})  # the model's reply goes here
    return msgs


def tau_conversation(path: str, index: int) -> list[dict[str, Any]]:
    """A tau-bench trajectory; recorded assistant messages become slots for the model's replies."""
    data = json.loads(Path(path).read_text())
    traj = data[index]["traj"]
    msgs = []
    for m in traj:
        if m["role"] == "assistant":
            msgs.append({"role": "assistant", "content": None})
        else:
            msgs.append({"role": m["role"], "content": str(m.get("content") or "")})
    return msgs


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class IdealSession:
    """Keeps one live model state across turns: prefill only what the previous turn did not cover."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.state = engine.new_state()
        self.tokens: list[int] = []

    def prefill(self, prompt: list[int]) -> tuple[float, int]:
        """Seconds to the last token's logits, and how many tokens the live state already held."""
        t0 = time.perf_counter()
        keep = min(_lcp(self.tokens, prompt), len(prompt) - 1)
        if keep < len(self.tokens) and self.engine.layout.requires_checkpoint:
            keep = 0  # recurrent state cannot be rewound
        if keep == 0:
            self.state = self.engine.new_state()
        elif keep < len(self.tokens):
            self.engine.crop(self.state, keep)
        pos = keep
        chunk = self.engine.prefill_chunk
        while pos < len(prompt):
            end = min(len(prompt), (pos // chunk + 1) * chunk)
            self.engine.to_numpy(self.engine.forward(self.state, prompt[pos:end]))
            pos = end
        self.tokens = list(prompt)
        return time.perf_counter() - t0, keep

    def feed(self, ids: list[int]) -> None:
        """The reply: decoded, not timed (it happens after the response in a real server)."""
        for t in ids:
            self.engine.forward(self.state, [t])
        self.tokens += ids


def measure(
    mode: str, on: Any, off: Any, ideal: IdealSession, prompt: list[int], params: Any
) -> dict[str, Any]:
    from promptcache.engines.base import Finished, PrefillDone, SamplingParams

    if mode == "on":
        events = list(on.generate(prompt, params))
        return {
            "pre": next(e for e in events if isinstance(e, PrefillDone)),
            "fin": next(e for e in events if isinstance(e, Finished)),
        }
    if mode == "off":
        return {
            "off": next(
                e
                for e in off.generate(prompt, SamplingParams(max_tokens=1))
                if isinstance(e, PrefillDone)
            )
        }
    return {"ideal": ideal.prefill(prompt)}


def run_once(
    model: Any, tokenizer: Any, conv: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    from promptcache.engines.base import SamplingParams
    from promptcache.engines.factory import engine_class, pick_engine

    engine_cls = engine_class(pick_engine(args.engine))
    common = dict(
        block_size=args.block_size, prefill_chunk=args.prefill_chunk, max_context=args.max_context
    )
    on = engine_cls(model, tokenizer, ram_budget=args.ram_budget, **common)
    off = engine_cls(model, tokenizer, cache_enabled=False, **common)
    ideal = IdealSession(off)
    params = SamplingParams(max_tokens=args.max_tokens)
    history: list[dict[str, Any]] = []
    rows = []
    for msg in conv:
        if msg["content"] is not None:
            history.append(msg)
            continue
        if len(rows) >= args.turns:
            break
        prompt = on.encode_chat(history)
        if len(prompt) + args.max_tokens >= on.max_context:
            print(f"stopping after {len(rows)} turns: turn {len(rows) + 1} has {len(prompt)} "
                  f"prompt tokens, over the model's context of {on.max_context}")  # fmt: skip
            break
        # rotate the order each turn so no mode always runs first (or right after a decode)
        got: dict[str, Any] = {}
        order = ("on", "off", "ideal")
        k = len(rows) % 3
        for mode in order[k:] + order[:k]:
            got.update(measure(mode, on, off, ideal, prompt, params))
        pre, fin, off_pre = got["pre"], got["fin"], got["off"]
        t_ideal, reused = got["ideal"]
        ideal.feed(fin.completion_ids)
        rows.append(
            {
                "turn": len(rows) + 1,
                "prompt_tokens": len(prompt),
                "cached_tokens": pre.cached_tokens,
                "ideal_reused_tokens": reused,
                "ttft_on_s": pre.ttft_s,
                "ttft_off_s": off_pre.ttft_s,
                "ttft_ideal_s": t_ideal,
            }
        )
        history.append({"role": "assistant", "content": fin.text})
    on.cache.check_integrity()
    return rows


def summarize(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for i in range(min(len(r) for r in runs)):
        row = dict(runs[0][i])
        for key in ("ttft_on_s", "ttft_off_s", "ttft_ideal_s"):
            row[key] = statistics.median(r[i][key] for r in runs)
        row["on_vs_off"] = row["ttft_on_s"] / row["ttft_off_s"]
        row["on_vs_ideal"] = row["ttft_on_s"] / row["ttft_ideal_s"]
        out.append(row)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| turn | prompt tok | cached tok | TTFT on (ms) | TTFT off (ms) | TTFT ideal (ms) | on/off | on/ideal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_on_s'] * 1e3:.1f} | "
            f"{r['ttft_off_s'] * 1e3:.1f} | {r['ttft_ideal_s'] * 1e3:.1f} | {r['on_vs_off']:.3f} | {r['on_vs_ideal']:.3f} |"
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("ttft_off_s", "cache off"),
        ("ttft_on_s", "promptcache"),
        ("ttft_ideal_s", "ideal (live KV)"),
    ):
        ax.plot(turns, [r[key] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> int:
    from promptcache.engines.base import SamplingParams
    from promptcache.engines.factory import check_engine_reads, engine_class, pick_engine
    from promptcache.models import prepare_model
    from promptcache.models.sources import locate_model

    found = locate_model(args.model, args.revision)
    kind = args.engine = pick_engine(args.engine, found)  # run_once builds the same engine
    engine_cls = engine_class(kind)
    check_engine_reads(kind, found)
    quant = {}
    if args.weights not in (None, "model"):
        from promptcache.errors import ConfigError

        if kind != "torch":
            raise ConfigError(f"--weights {args.weights} needs --engine torch")
        quant["weights"] = args.weights  # checked by load_weights
    path = prepare_model(found)
    model, tokenizer = engine_cls.load_weights(
        path, dtype=args.dtype, device=args.device, max_context=args.max_context, **quant
    )
    if args.conversation:
        conv, source = (
            tau_conversation(args.conversation, args.index),
            f"{Path(args.conversation).name}[{args.index}]",
        )
    else:
        conv, source = synthetic_conversation(args.turns), "synthetic"
    warm = engine_cls(model, tokenizer, cache_enabled=False)
    # first-forward costs, untimed (ids from the tokenizer: any vocabulary size)
    list(
        warm.generate(
            warm.encode_text("warm up the model " * 128)[:512], SamplingParams(max_tokens=2)
        )
    )
    runs = []
    for r in range(args.repeats):
        print(f"run {r + 1}/{args.repeats} ...", flush=True)
        runs.append(run_once(model, tokenizer, conv, args))
    rows = summarize(runs)
    where = args.device if kind == "torch" else "mlx"
    title = f"{found.name} on {where}, {source}, median of {args.repeats}"
    print(f"\n{title}\n")
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(path), "conversation": source, "repeats": args.repeats, "block_size": args.block_size,
            "prefill_chunk": args.prefill_chunk, "max_tokens": args.max_tokens, "engine": kind}  # fmt: skip
    (out / "bench.json").write_text(
        json.dumps({"meta": meta, "turns": rows, "runs": runs}, indent=2)
    )
    plot(rows, out / "ttft.png", title)
    print(f"\nwrote {out / 'bench.json'} and {out / 'ttft.png'}")
    return 0
