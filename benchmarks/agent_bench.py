"""Agent benchmark: a tau-bench trajectory replayed through two real `promptcache serve` processes.

An agent client (the official ``openai`` client, streaming) walks a recorded trajectory. At each
recorded assistant message it sends the history so far plus the OpenAI function tools:

- recorded tool call: the same tool is forced (``tool_choice`` named, ``parallel_tool_calls``
  false); the model's own assistant message (its tool call, its call id, as streamed back) is
  appended, then the recorded tool result(s) under the returned call id;
- recorded text: the model replies (``--max-tokens``, ``tool_choice="none"`` so the history keeps
  following the recording) and its reply is appended.

The recorded user and tool messages in between are appended as they are. The cache-on server's
replies build the history; the same message list is sent to both servers every turn, the order
of on / off / ideal rotating per turn so that machine noise hits them alike.

Servers: ``--no-ssd`` (RAM tier only, restarted each repeat so every repeat starts cold) and
``--no-cache``. Both are warmed (a first forward and the tool grammar, in a separate tenant)
before the timed turns. The off server is asked for ``max_tokens=1``: same prompt, same
grammar, only its TTFT is used.

Per turn: prompt_tokens and cached_tokens (``stream_options.include_usage``), TTFT = seconds
from sending the request to the first SSE chunk (the server sends it right after the prefill),
for on and off; reuse = cached_tokens / (previous turn's prompt_tokens + completion_tokens) on
the cache-on server.

Ideal (in this process, no HTTP): the same model loaded with the cache off, each turn's prompt
rendered with the server's own code (``ChatCompletionRequest`` -> ``openai_api.to_chat`` ->
``ChatFormatter.render``), timed with ``promptcache.cli.bench.IdealSession``: one live KV state kept
across turns. After turn k it holds turn k's prompt; before timing turn k+1 it is extended,
untimed, by the tokens of the reply as turn k+1's prompt renders it (the ``completion_tokens``
of turn k that follow turn k's prompt, when turn k+1's prompt starts with turn k's). The timed
part is cropping to the common prefix and prefilling the rest to the last token's logits:
what a perfect single-session cache could do, without HTTP, tokenization, or rendering costs.
(The in-process formatter does not have the server's memory of raw reply text, so it renders
tool calls in the parser's canonical form; its prompt length is kept as ``ideal_prompt_tokens``.)

Writes ``agent_bench.json`` and ``agent_ttft.png`` to ``--out``; prints a table and last the two
targets: min reuse over turns 2.. >= 95%, and turn-8 TTFT on/off <= 0.2.

    .venv/bin/python benchmarks/agent_bench.py \
        --conversation DATA_DIR/tau_bench/gpt-4o-airline.json --turns 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from promptcache.cli.bench import IdealSession, plot, summarize
from promptcache.server.launcher import ServerProcess

TENANT_HEADER = "x-promptcache-tenant"
REUSE_TARGET = 0.95
RATIO_TARGET = 0.2
RATIO_TURN = 8


# -- the conversation and its tools --------------------------------------------------------------


def load_trajectory(path: str, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    data = json.loads(Path(path).read_text())
    entry = data[index]
    return entry, entry["traj"]


def _schema_of(values: list[Any]) -> dict[str, Any]:
    """A JSON schema covering every observed value (objects closed, keys seen always required)."""
    kinds = set()
    for v in values:
        if isinstance(v, bool):
            kinds.add("boolean")
        elif isinstance(v, int):
            kinds.add("integer")
        elif isinstance(v, float):
            kinds.add("number")
        elif isinstance(v, str):
            kinds.add("string")
        elif v is None:
            kinds.add("null")
        elif isinstance(v, list):
            kinds.add("array")
        elif isinstance(v, dict):
            kinds.add("object")
    if kinds == {"integer", "number"}:
        kinds = {"number"}
    if len(kinds) != 1:
        return {}  # mixed or no observations: any JSON value
    kind = kinds.pop()
    if kind == "array":
        items = [x for v in values for x in v]
        return {"type": "array", "items": _schema_of(items)} if items else {"type": "array"}
    if kind == "object":
        return _object_schema(values)
    if kind == "string":  # as real tool schemas bound ids and codes; the recorded values fit
        return {"type": "string", "maxLength": max(64, 2 * max(len(v) for v in values))}
    return {"type": kind}


def _object_schema(objects: list[dict[str, Any]]) -> dict[str, Any]:
    keys: list[str] = []
    for o in objects:
        keys += [k for k in o if k not in keys]
    return {
        "type": "object",
        "properties": {k: _schema_of([o[k] for o in objects if k in o]) for k in keys},
        "required": [k for k in keys if all(k in o for o in objects)],
        "additionalProperties": False,
    }


def _recorded_calls(traj: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for m in traj:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments")
            args = json.loads(args) if isinstance(args, str) else args
            calls.append((fn["name"], args if isinstance(args, dict) else {}))
    return calls


def build_tools(entry: dict[str, Any], traj: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI function tools: real schemas if the file has them (an entry's ``tools`` or
    ``info.tools``), else one per tool called in the trajectory (and in the task's ground-truth
    ``info.task.actions``), its parameters inferred from the observed arguments."""
    for found in (entry.get("tools"), (entry.get("info") or {}).get("tools")):
        if isinstance(found, list) and found:
            return [t if "function" in t else {"type": "function", "function": t} for t in found]
    seen: dict[str, list[dict[str, Any]]] = {}
    for name, args in _recorded_calls(traj):
        seen.setdefault(name, []).append(args)
    task = (entry.get("info") or {}).get("task") or {}
    for action in task.get("actions") or []:
        if isinstance(action, dict) and action.get("name"):
            seen.setdefault(action["name"], []).append(action.get("kwargs") or {})
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"The {name.replace('_', ' ')} tool.",
                "parameters": _object_schema(observed),
            },
        }
        for name, observed in seen.items()
    ]


# -- one streamed request ------------------------------------------------------------------------


def stream_chat(
    client: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    tool_choice: Any,
    max_tokens: int,
    tenant: str = "",
) -> dict[str, Any]:
    """Send one streaming request; TTFT = request sent -> first SSE chunk received."""
    extra = {"tool_choice": tool_choice}
    if isinstance(tool_choice, dict):
        extra["parallel_tool_calls"] = False
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="any",
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={TENANT_HEADER: tenant} if tenant else None,
        **extra,
    )
    ttft = None
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    finish = None
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(
                    tc.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.id:
                    call["id"] = tc.id
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
    assert ttft is not None and usage is not None
    details = usage.prompt_tokens_details
    return {
        "ttft_s": ttft,
        "content": content,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
    }


# -- the in-process ideal ------------------------------------------------------------------------


class Ideal:
    """Same model, cache off, prompts rendered by the server's own code, timed by IdealSession."""

    def __init__(self, engine: Any) -> None:
        from promptcache.server.chat import ChatFormatter

        self.engine = engine
        self.formatter = ChatFormatter(engine)
        self.session = IdealSession(engine)
        self.prev_prompt: list[int] = []
        self.prev_completion = 0

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any
    ) -> list[int]:
        from promptcache.server.openai_api import to_chat
        from promptcache.server.schemas.openai import ChatCompletionRequest

        req = ChatCompletionRequest(
            model="any", messages=messages, tools=tools, tool_choice=tool_choice
        )
        return self.formatter.render(to_chat(req), "")

    def prefill(self, prompt: list[int]) -> tuple[float, int]:
        """Extend the live state (untimed) by the previous reply as this prompt renders it,
        then time the prefill of what is left."""
        n = len(self.prev_prompt)
        if n and self.session.tokens == self.prev_prompt and prompt[:n] == self.prev_prompt:
            reply = prompt[n : min(n + self.prev_completion, len(prompt) - 1)]
            if reply:
                self.engine.forward(self.session.state, reply)
                self.session.tokens += reply
        return self.session.prefill(prompt)

    def done(self, prompt: list[int], completion_tokens: int) -> None:
        self.prev_prompt, self.prev_completion = prompt, completion_tokens


# -- one repeat ----------------------------------------------------------------------------------


def warm(client: Any, tools: list[dict[str, Any]]) -> None:
    """First-forward costs and the tool grammar, in a tenant the timed turns never use."""
    msgs = [{"role": "user", "content": "Warm up. " * 200}]
    stream_chat(client, msgs, tools, "none", 2, tenant="warmup")
    named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    stream_chat(client, msgs, tools, named, 8, tenant="warmup")


def run_once(
    args: argparse.Namespace,
    traj: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    off: ServerProcess,
    ideal: Ideal,
    out: Path,
    rep: int,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    from openai import OpenAI

    on = ServerProcess(
        args.server_args + ["--no-ssd"], log=out / f"server-on-{rep}.log", log_level="info"
    ).start(timeout=300)
    try:
        c_on = OpenAI(base_url=on.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        c_off = OpenAI(base_url=off.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        warm(c_on, tools)
        ideal.session = IdealSession(ideal.engine)
        ideal.prev_prompt, ideal.prev_completion = [], 0
        history: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        prev_total = None
        i = 0
        while i < len(traj) and len(rows) < args.turns:
            m = traj[i]
            i += 1
            if m["role"] != "assistant":
                msg = {"role": m["role"], "content": str(m.get("content") or "")}
                if m["role"] == "tool":
                    msg["tool_call_id"] = m.get("tool_call_id") or ""
                    if m.get("name"):
                        msg["name"] = m["name"]
                history.append(msg)
                continue
            recorded = m.get("tool_calls") or []
            if recorded:
                name = recorded[0]["function"]["name"]
                choice: Any = {"type": "function", "function": {"name": name}}
                max_tokens = args.max_call_tokens
            else:
                name, choice, max_tokens = None, "none", args.max_tokens
            sent = [dict(x) for x in history]
            got: dict[str, Any] = {}
            order = ("on", "off", "ideal")
            k = len(rows) % 3
            for mode in order[k:] + order[:k]:
                if mode == "on":
                    got["on"] = stream_chat(c_on, sent, tools, choice, max_tokens)
                    time.sleep(0.1)  # the server saves prompt + reply after the last chunk
                elif mode == "off":
                    got["off"] = stream_chat(c_off, sent, tools, choice, 1)
                else:
                    prompt = ideal.render(sent, tools, choice)
                    got["ideal"] = (prompt, *ideal.prefill(prompt))
            r_on, r_off = got["on"], got["off"]
            prompt, t_ideal, kept = got["ideal"]
            ideal.done(prompt, r_on["completion_tokens"])
            reuse = r_on["cached_tokens"] / prev_total if prev_total else None
            prev_total = r_on["prompt_tokens"] + r_on["completion_tokens"]
            # the agent appends the model's own reply
            reply: dict[str, Any] = {"role": "assistant", "content": r_on["content"] or None}
            call_ok = None
            if recorded:
                returned = [c for c in r_on["tool_calls"] if c["id"]]
                call_ok = bool(returned) and returned[0]["function"]["name"] == name
                if returned:
                    reply["tool_calls"] = returned
                # else the call was cut short: the model's text goes back as it came (as a client
                # would send it), and the recorded results follow under the recorded ids
                ids = [c["id"] for c in reply.get("tool_calls") or recorded]
                history.append(reply)
                j = 0
                while i < len(traj) and traj[i]["role"] == "tool":
                    t = traj[i]
                    res = {"role": "tool", "content": str(t.get("content") or "")}
                    res["tool_call_id"] = ids[min(j, len(ids) - 1)]
                    if t.get("name"):
                        res["name"] = t["name"]
                    history.append(res)
                    i += 1
                    j += 1
            else:
                reply["content"] = r_on["content"]
                history.append(reply)
            rows.append(
                {
                    "turn": len(rows) + 1,
                    "kind": f"call {name}" if recorded else "text",
                    "prompt_tokens": r_on["prompt_tokens"],
                    "prompt_tokens_off": r_off["prompt_tokens"],
                    "ideal_prompt_tokens": len(prompt),
                    "completion_tokens": r_on["completion_tokens"],
                    "cached_tokens": r_on["cached_tokens"],
                    "cached_tokens_off": r_off["cached_tokens"],
                    "ideal_reused_tokens": kept,
                    "reuse": reuse,
                    "call_ok": call_ok,
                    "finish_reason": r_on["finish_reason"],
                    "ttft_on_s": r_on["ttft_s"],
                    "ttft_off_s": r_off["ttft_s"],
                    "ttft_ideal_s": t_ideal,
                }
            )
            r = rows[-1]
            print(
                f"  turn {r['turn']:2d} {r['kind']:<32} prompt {r['prompt_tokens']:5d} "
                f"+{r['completion_tokens']:3d} cached {r['cached_tokens']:5d} reuse {_pct(reuse):>6}  on {r['ttft_on_s'] * 1e3:7.1f} ms  "
                f"off {r['ttft_off_s'] * 1e3:7.1f} ms  ideal {t_ideal * 1e3:7.1f} ms",
                flush=True,
            )
            partial = {"repeat": rep, "turns": rows}
            (out / "agent_bench.partial.json").write_text(json.dumps(partial, indent=2))
        stats = on.stats()
    finally:
        on.stop()
    return rows, stats, history


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| turn | kind | prompt tok | cached on | reuse | TTFT on (ms) | TTFT off (ms) | TTFT ideal (ms) | on/off |"
    )
    print("|---:|:---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['turn']} | {r['kind']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{_pct(r['reuse_min'])} | {r['ttft_on_s'] * 1e3:.1f} | {r['ttft_off_s'] * 1e3:.1f} | "
            f"{r['ttft_ideal_s'] * 1e3:.1f} | {r['on_vs_off']:.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversation", required=True, help="tau-bench trajectories (JSON list)")
    p.add_argument("--index", type=int, default=0, help="trajectory index (default 0)")
    p.add_argument("--turns", type=int, default=10, help="assistant turns to run (default 10)")
    p.add_argument("--model", default=None, help="model (default: the bundled one)")
    p.add_argument("--max-tokens", type=int, default=32, help="text replies (default 32)")
    p.add_argument(
        "--max-call-tokens", type=int, default=256, help="forced tool calls (default 256)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs; medians (default 3)")
    p.add_argument("--out", default="bench-out", help="agent_bench.json, agent_ttft.png")
    p.add_argument("--engine", default="torch")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.server_args = ["--engine", args.engine] + (["--model", args.model] if args.model else [])

    from promptcache.engines.base import SamplingParams
    from promptcache.engines.factory import build_engine

    entry, traj = load_trajectory(args.conversation, args.index)
    tools = build_tools(entry, traj)
    source = f"{Path(args.conversation).name}[{args.index}]"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{source}: {len(traj)} messages, tools: {[t['function']['name'] for t in tools]}")

    engine = build_engine(args.engine, args.model, cache_enabled=False)
    list(engine.generate(list(range(100, 612)), SamplingParams(max_tokens=2)))  # untimed warm-up
    ideal = Ideal(engine)
    off = ServerProcess(
        args.server_args + ["--no-cache", "--no-ssd"], log=out / "server-off.log", log_level="info"
    )
    off.start(timeout=300)
    runs, stats, histories = [], [], []
    try:
        from openai import OpenAI

        warm(OpenAI(base_url=off.url + "/v1", api_key="unused", max_retries=0), tools)
        for rep in range(args.repeats):
            print(f"run {rep + 1}/{args.repeats} ...", flush=True)
            rows, st, hist = run_once(args, traj, tools, off, ideal, out, rep)
            runs.append(rows)
            stats.append(st)
            histories.append(hist)
    finally:
        off.stop()

    rows = summarize(runs)
    for i, r in enumerate(rows):
        vals = [run[i]["reuse"] for run in runs if run[i]["reuse"] is not None]
        r["reuse_min"] = min(vals) if vals else None
        r["cached_tokens_min"] = min(run[i]["cached_tokens"] for run in runs)
    model = getattr(engine, "model_id", args.model or "default")
    title = f"{model}, {source}, HTTP agent, median of {args.repeats}"
    print(f"\n{title}\n")
    print_table(rows)
    meta = {"model": str(model), "conversation": source, "repeats": args.repeats,
            "max_tokens": args.max_tokens, "max_call_tokens": args.max_call_tokens,
            "engine": args.engine, "tools": tools}  # fmt: skip
    continuity = [s.get("continuity") for s in stats]
    (out / "agent_bench.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "turns": rows,
                "runs": runs,
                "continuity": continuity,
                "history": histories[0] if histories else [],
            },
            indent=2,
        )
    )
    plot(rows, out / "agent_ttft.png", title)
    print(f"\nwrote {out / 'agent_bench.json'} and {out / 'agent_ttft.png'}")
    for rep, c in enumerate(continuity):
        gaps = (c or {}).get("recent_gaps") or []
        if gaps:
            print(f"run {rep + 1}: continuity gaps on the cache-on server: {json.dumps(gaps)}")
    bad_calls = [r["turn"] for run in runs for r in run if r["call_ok"] is False]
    if bad_calls:
        print(f"turns where the forced call did not come back parsed: {sorted(set(bad_calls))}")

    reuses = [r["reuse_min"] for r in rows if r["reuse_min"] is not None]
    min_reuse = min(reuses) if reuses else None
    ok_reuse = min_reuse is not None and min_reuse >= REUSE_TARGET
    print(f"\ntarget: min reuse over turns 2..{len(rows)} >= {REUSE_TARGET:.0%}: "
          f"{_pct(min_reuse)} -> {'PASS' if ok_reuse else 'FAIL'}")  # fmt: skip
    if len(rows) >= RATIO_TURN:
        ratio = rows[RATIO_TURN - 1]["on_vs_off"]
        print(f"target: turn-{RATIO_TURN} TTFT on/off <= {RATIO_TARGET}: {ratio:.3f} -> "
              f"{'PASS' if ratio <= RATIO_TARGET else 'FAIL'}")  # fmt: skip
    else:
        print(f"target: turn-{RATIO_TURN} TTFT on/off: not reached ({len(rows)} turns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
