"""vLLM alone vs vLLM + promptcache (the KV connector) on one multi-turn conversation.

One server at a time, same run, greedy replies the client keeps in its history:

    alone        vLLM (its own prefix cache): turns 1..N and N+1 (warm: the floor after a
                 restart), then restarted: turn N+1 (cold),
                 turn N+2 under a fresh cache_salt (what a second instance sees: nothing), decode
    promptcache  vLLM + connector (SSD folder + Valkey): turns 1..N, restarted on the same
                 folder: turn N+1 (our SSD tier), then a second instance B with its own empty
                 folder and the same Valkey: turn N+2 (the shared tier), decode

TTFT is measured at the client (streamed, first content chunk); decode tok/s from one request of
``--decode`` tokens (``ignore_eos``), after its first token.

    .venv/bin/python benchmarks/vllm_bench.py \\
        --conversation DATA_DIR/tau_bench/gpt-4o-airline.json --turns 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from promptcache.cli.bench import synthetic_conversation, tau_conversation  # noqa: E402
from promptcache.server.launcher import free_port  # noqa: E402
from promptcache.vllm.process import VllmServer, connector_config  # noqa: E402


def user_turns(conv: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The conversation cut at each assistant slot: what comes before it (tool results as user
    turns, so any chat template takes them)."""
    out, msgs = [], []
    for m in conv:
        if m["role"] == "assistant":
            if msgs and msgs[-1]["role"] != "assistant":
                out.append(list(msgs))
            msgs.append({"role": "assistant", "content": None})
        else:
            role = "user" if m["role"] == "tool" else m["role"]
            msgs.append({"role": role, "content": m["content"]})
    return out


class Client:
    def __init__(self, server: VllmServer, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        self.max_tokens = max_tokens

    def turn(self, messages: list[dict[str, Any]], salt: str, **extra: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        first = last = None
        text, usage, n = "", None, 0
        stream = self.client.chat.completions.create(
            model="model", messages=messages, max_tokens=extra.pop("max_tokens", self.max_tokens),
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt, **extra}, timeout=900,
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                first = first or now
                last, n = now, n + 1
                text += chunk.choices[0].delta.content
        details = usage.prompt_tokens_details if usage else None
        return {
            "text": text,
            "ttft_ms": ((first or time.perf_counter()) - t0) * 1000,
            "prompt": usage.prompt_tokens if usage else 0,
            "cached": (details.cached_tokens or 0) if details else 0,
            "completion": usage.completion_tokens if usage else 0,
            "decode_tok_s": (n - 1) / (last - first) if first and last and last > first else 0.0,
        }


class Conversation:
    """The client's side: prompts with the model's own replies filled in."""

    def __init__(self, cuts: list[list[dict[str, Any]]]) -> None:
        self.cuts = cuts
        self.replies: list[str] = []

    def messages(self, i: int) -> list[dict[str, Any]]:
        it = iter(self.replies)
        return [m if m["content"] is not None else {**m, "content": next(it)} for m in self.cuts[i]]


def run_mode(args: argparse.Namespace, mode: str, tmp: Path, valkey_url: str | None) -> dict:
    cuts = user_turns(load_conversation(args))[: args.turns + 2]
    conv = Conversation(cuts)
    n = len(cuts) - 2
    kv = None
    if mode == "promptcache":
        kv = connector_config(cache_dir=str(tmp / "cache-a"), shared_tier=valkey_url)

    def server(name: str, kv_transfer: dict | None) -> VllmServer:
        return VllmServer(args.vllm_python, args.model, free_port(), tmp / f"{mode}-{name}.log",
                          kv_transfer=kv_transfer, max_model_len=8192).start()  # fmt: skip

    rows: list[dict[str, Any]] = []

    def ask(srv: VllmServer, i: int, label: str, salt: str = "bench") -> None:
        r = Client(srv, args.max_tokens).turn(conv.messages(i), salt)
        if len(conv.replies) == i:
            conv.replies.append(r["text"])
        rows.append({"turn": label, **{k: v for k, v in r.items() if k != "text"}})
        print(f"  {mode:<12} {label:<18} prompt {r['prompt']:>6} cached {r['cached']:>6} "
              f"TTFT {r['ttft_ms']:>8.0f} ms", flush=True)  # fmt: skip

    srv = server("a", kv)
    try:
        for i in range(n):
            ask(srv, i, f"{i + 1}")
        if mode == "alone":  # the floor after a restart: the same turn on a warm cache
            ask(srv, n, f"{n + 1} warm")
            conv.replies.pop()
    finally:
        srv.stop()
    srv = server("a-restarted", kv)
    try:
        ask(srv, n, f"{n + 1} after restart")
        if mode == "alone":  # a second vLLM holds nothing: a fresh salt is just as cold
            ask(srv, n + 1, f"{n + 2} 2nd instance", salt="second-instance")
            rows.append({"turn": "decode", **decode(srv, conv, args)})
    finally:
        srv.stop()
    if mode == "promptcache":
        kv_b = connector_config(cache_dir=str(tmp / "cache-b"), shared_tier=valkey_url)
        srv = server("b", kv_b)
        try:
            ask(srv, n + 1, f"{n + 2} 2nd instance")
            rows.append({"turn": "decode", **decode(srv, conv, args)})
            rows.append({"turn": "metrics", **srv.metrics()})
        finally:
            srv.stop()
    return {"mode": mode, "rows": rows}


def decode(srv: VllmServer, conv: Conversation, args: argparse.Namespace) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "Write a long story about a flight."}]
    r = Client(srv, args.decode).turn(msgs, "decode", ignore_eos=True)
    return {"decode_tok_s": r["decode_tok_s"], "completion": r["completion"]}


def run_paired(args: argparse.Namespace, tmp: Path, valkey_url: str | None) -> None:
    """Both servers up at once (idle but for the request in flight), turns and decode requests
    alternated (which goes first alternates too), ``--passes`` conversations under a salt each
    (each cold on both): machine noise hits both alike. Prints per-turn medians and ratios,
    then ``--repeats`` decode pairs."""
    cuts = user_turns(load_conversation(args))[: args.turns]
    kv = connector_config(cache_dir=str(tmp / "cache-p"), shared_tier=valkey_url)
    servers = [
        VllmServer(
            args.vllm_python,
            args.model,
            free_port(),
            tmp / f"paired-{name}.log",
            kv_transfer=k,
            max_model_len=8192,
        )  # fmt: skip
        for name, k in (("alone", None), ("promptcache", kv))
    ]
    for srv in servers:
        srv.start()
    try:
        ttft: list[list[list[float]]] = [[[], []] for _ in cuts]  # turn -> server -> runs
        cached: list[list[int]] = [[0, 0] for _ in cuts]
        for p in range(args.passes):  # a salt per pass: each starts cold on both servers
            convs = [Conversation(cuts), Conversation(cuts)]
            for i in range(len(cuts)):
                order = [0, 1] if (i + p) % 2 == 0 else [1, 0]  # neither always goes first
                for k in order:
                    r = Client(servers[k], args.max_tokens).turn(convs[k].messages(i), f"p{p}")
                    convs[k].replies.append(r["text"])
                    ttft[i][k].append(r["ttft_ms"])
                    cached[i][k] = r["cached"]
        med = statistics.median
        print(f"medians of {args.passes} passes")
        print("| turn | vLLM alone TTFT ms (cached) | + promptcache TTFT ms (cached) | ratio |")
        print("|---|---|---|---|")
        for i, (a, c) in enumerate(ttft):
            ratios = [y / x for x, y in zip(a, c, strict=True)]
            print(f"| {i + 1} | {med(a):.0f} ({cached[i][0]}) | {med(c):.0f} ({cached[i][1]}) | "
                  f"{med(ratios):.2f}x |", flush=True)  # fmt: skip
        hits = [y / x for a, c in ttft[1:] for x, y in zip(a, c, strict=True)]
        if hits:
            print(f"turns 2..{len(cuts)}: median ratio {med(hits):.2f}x over {len(hits)} pairs")
        for k in range(args.repeats):
            d = [decode(srv, Conversation(cuts), args)["decode_tok_s"] for srv in servers]
            print(
                f"decode pair {k + 1}: vLLM alone {d[0]:.1f} tok/s, + promptcache {d[1]:.1f} tok/s"
            )
    finally:
        for srv in servers:
            srv.stop()


def load_conversation(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.conversation:
        return tau_conversation(args.conversation, args.index)
    return synthetic_conversation(2 * (args.turns + 2))


def print_table(results: list[dict]) -> None:
    alone = {r["turn"]: r for r in results[0]["rows"]}
    cached = {r["turn"]: r for r in results[1]["rows"]}
    print(
        "\n| turn | prompt tokens | vLLM alone TTFT ms (cached) | + promptcache TTFT ms (cached) | ratio |"
    )
    print("|---|---|---|---|---|")
    ratios = []
    for turn, a in alone.items():
        c = cached.get(turn)
        if c is None or turn in ("decode", "metrics"):
            continue
        ratio = c["ttft_ms"] / a["ttft_ms"] if a["ttft_ms"] else 0.0
        if turn[0].isdigit() and " " not in turn and turn != "1":
            ratios.append(ratio)
        print(f"| {turn} | {a['prompt']} | {a['ttft_ms']:.0f} ({a['cached']}) | "
              f"{c['ttft_ms']:.0f} ({c['cached']}) | {ratio:.2f}x |")  # fmt: skip
    if ratios:
        print(
            f"\nturns vLLM's own cache serves (2..N): median ratio {statistics.median(ratios):.2f}x"
        )
    warm = next((r for t, r in alone.items() if t.endswith(" warm")), None)
    after = next((r for t, r in cached.items() if t.endswith("after restart")), None)
    if warm and after:
        print(f"after a restart, promptcache {after['ttft_ms']:.0f} ms vs vLLM alone never "
              f"restarted (warm) {warm['ttft_ms']:.0f} ms: {after['ttft_ms'] / warm['ttft_ms']:.2f}x "
              f"(the turn's {after['prompt'] - after['cached']} uncached tokens bound both)")  # fmt: skip
    print(f"decode tok/s: vLLM alone {alone['decode']['decode_tok_s']:.1f}, "
          f"+ promptcache {cached['decode']['decode_tok_s']:.1f}")  # fmt: skip
    m = cached.get("metrics", {})
    print(
        "connector counters (instance B):",
        {k.split("promptcache_")[1]: v for k, v in m.items() if k != "turn"},
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversation", help="tau-bench JSON (default: a synthetic conversation)")
    p.add_argument("--index", type=int, default=0, help="trajectory in the file")
    p.add_argument("--turns", type=int, default=6, help="turns before the restart")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--decode", type=int, default=128, help="tokens of the decode measurement")
    p.add_argument("--vllm-python", default=str(Path(".venv-vllm/bin/python")))
    p.add_argument("--model", help="model folder (default: the bundled SmolLM2-135M, float32)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument(
        "--paired",
        action="store_true",
        help="both servers up at once, requests alternated (no restart / 2nd instance)",
    )
    p.add_argument("--repeats", type=int, default=3, help="decode pairs with --paired")
    p.add_argument("--passes", type=int, default=3, help="conversations with --paired (medians)")
    args = p.parse_args()
    if args.model is None:
        from promptcache.models import resolve_model

        args.model = str(resolve_model(None))
    from valkey_helpers import ValkeyProcess

    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as d:
        tmp = Path(d)
        valkey = ValkeyProcess(tmp / "valkey").start()
        try:
            if args.paired:
                run_paired(args, tmp, valkey.url)
                return 0
            results = [run_mode(args, m, tmp, valkey.url) for m in ("alone", "promptcache")]
        finally:
            valkey.stop()
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
