"""Cost of the per-request cache record (miss diagnosis included) against a cache-hit request.

Run: .venv/bin/python benchmarks/record_bench.py [--history 4000] [--turns 8] [--json out.json]
Uses the bundled model (float32, CPU). Each turn of a growing conversation is served as a cache
hit (reused history, a new user message, ``--max-tokens`` generated) through the same engine and
``ServerState.record`` the HTTP path uses; the record is timed on its own, with the prompt memory
full of earlier turns (the worst case: every earlier prompt shares the history). Target: the
record costs at most 1% of a cache-hit request's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from promptcache.engines.base import Finished, PrefillDone, SamplingParams
from promptcache.engines.torch.engine import TorchEngine
from promptcache.models import resolve_model
from promptcache.server.chat import Chat
from promptcache.server.state import ServerState

FILLER = (
    "The customer asks to move the flight to the next morning, keep the seat, and confirm the "
    "baggage allowance; check the fare rules before changing anything. "
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=4000, help="tokens of history before turn 1")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20, help="timed records per turn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engine = TorchEngine.load(resolve_model(None), max_context=8192, ram_budget="4GB")
    state = ServerState(engine)
    system = FILLER * max(1, args.history // len(engine.encode_text(FILLER)))
    messages = [{"role": "system", "content": system}]
    request_s, record_s, prompt_lens, reasons = [], [], [], []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Turn {turn}: what changes now?"})
        chat = Chat(list(messages))
        prompt = state.formatter.render(chat)
        params = SamplingParams(max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        prefill, fin = None, None
        for ev in engine.generate(prompt, params):
            if isinstance(ev, PrefillDone):
                prefill = ev
            elif isinstance(ev, Finished):
                fin = ev
        elapsed = time.perf_counter() - t0
        assert prefill is not None and fin is not None
        rec = state.record("/v1/chat/completions", "", prompt, chat, prefill, fin)
        messages.append({"role": "assistant", "content": fin.text})
        if turn == 0:
            continue  # the cold first turn is not a cache hit
        times = []
        for _ in range(args.repeat):
            t1 = time.perf_counter()
            state.record("/v1/chat/completions", "", prompt, chat, prefill, fin)
            times.append(time.perf_counter() - t1)
        request_s.append(elapsed)
        record_s.append(statistics.median(times))
        prompt_lens.append(len(prompt))
        reasons.append(rec.reason)
        print(
            f"turn {turn}: {len(prompt):>5} prompt tokens, {fin.cached_tokens:>5} reused, "
            f"request {elapsed * 1e3:7.1f} ms, record {record_s[-1] * 1e6:7.0f} us "
            f"({100 * record_s[-1] / elapsed:.2f}%), reason {rec.reason}"
        )
    ratio = statistics.median(r / q for r, q in zip(record_s, request_s, strict=True))
    out = {
        "turns": len(request_s),
        "median_prompt_tokens": statistics.median(prompt_lens),
        "median_request_ms": round(statistics.median(request_s) * 1e3, 2),
        "median_record_us": round(statistics.median(record_s) * 1e6, 1),
        "median_record_share": round(ratio, 5),
        "prompts_in_memory": len(state.prompts),
        "reasons": reasons,
        "target_share": 0.01,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    engine.close()


if __name__ == "__main__":
    main()
