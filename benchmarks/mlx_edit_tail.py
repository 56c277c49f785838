"""A hybrid (SSM + attention) model whose conversation tail was edited: how much do the servers
reuse?

Turn 1 is a system prompt and a user message; in turn 2 the client sends the history back with
the assistant's reply either kept or rewritten (as clients that trim or rewrite replies do),
plus a new user message. An SSM state cannot be rewound, so a server can only reuse a state it
saved at or before the point where the prompts diverge. Reports the cached tokens each server
reports for turn 2, both ways. Default model: a tiny random Falcon-H1 (every layer a CacheList
of Mamba2 state + attention KV) saved in mlx-lm layout; any mlx-lm hybrid folder works.

    .venv/bin/python benchmarks/mlx_edit_tail.py [--model FOLDER]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import PeerServer, free_port  # noqa: E402

SYSTEM = (
    "You are a helpful assistant. Answer the user's question about flights, bookings and refunds. "
    * 4
)


def command(name: str, model: Path, port: int, work: Path, args: argparse.Namespace) -> list[str]:
    if name == "promptcache":
        return [sys.executable, "-m", "promptcache.cli", "serve", "--engine", "mlx", "--model",
                str(model), "--port", str(port), "--cache-dir", str(work / "ssd")]  # fmt: skip
    if name == "mlx_lm.server":
        return [args.mlx_lm_python, "-m", "mlx_lm.server", "--model", str(model), "--port",
                str(port), "--host", "127.0.0.1", "--max-tokens", str(args.max_tokens)]  # fmt: skip
    raise ValueError(name)


def conversation(server: PeerServer, user: str, edit: bool, max_tokens: int) -> dict[str, Any]:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]
    first = server.chat(history, max_tokens)
    reply = first["text"]
    if edit:  # the client rewrote the reply
        reply = "I have rebooked you on the 9:40 flight; the change fee is waived."
    history += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thanks. Can I also add a checked bag?"},
    ]
    second = server.chat(history, max_tokens)
    return {"turn1_prompt": first["prompt_tokens"], "prompt_tokens": second["prompt_tokens"],
            "cached_tokens": second["cached_tokens"], "ttft_s": second["ttft_s"]}  # fmt: skip


def edited_document(server: PeerServer, max_tokens: int) -> dict[str, Any]:
    """A long user message (a pasted document) sent again with its last part rewritten."""
    doc = " ".join(
        f"Clause {i}: refunds for flight HAT{100 + i} follow rule {i % 7}." for i in range(50)
    )
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": doc + " Summarise."},
    ]
    a = server.chat(first, max_tokens)
    cut = int(len(doc) * 0.75)
    second = [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": doc[:cut] + " (the rest was revised) Summarise."}]  # fmt: skip
    b = server.chat(second, max_tokens)
    return {"turn1_prompt": a["prompt_tokens"], "prompt_tokens": b["prompt_tokens"],
            "cached_tokens": b["cached_tokens"], "ttft_s": b["ttft_s"]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="an mlx-lm hybrid model folder (default: tiny Falcon-H1)"
    )
    p.add_argument("--mlx-lm-python", default=sys.executable)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--servers", default="promptcache,mlx_lm.server")
    p.add_argument("--out", default="bench-out/mlx_edit_tail.json")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="edit-tail-"))
    if args.model is None:
        from promptcache.testing.tiny_models import save_mlx_tiny_model

        model = Path(save_mlx_tiny_model("falcon_h1", str(tmp / "model")))
    else:
        model = Path(args.model)
    rows = []
    try:
        for name in args.servers.split(","):
            work = tmp / name
            work.mkdir()
            port = free_port()
            # mlx_lm.server's /v1/models lists the HF cache, not what it serves: name the folder
            server = PeerServer(name, command(name, model, port, work, args), port, work,
                                model=str(model))  # fmt: skip
            server.start()
            try:
                for edit in (False, True):
                    user = (
                        f"My booking is R{1000 + edit}. Please move me to an earlier flight today."
                    )
                    row = {"server": name, "reply": "edited" if edit else "kept",
                           **conversation(server, user, edit, args.max_tokens)}  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
                row = {"server": name, "reply": "user document edited at 75%",
                       **edited_document(server, args.max_tokens)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            finally:
                server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| server | turn 2 | turn-1 prompt | turn-2 prompt | turn-2 cached tokens |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['server']} | {r['reply']} | {r['turn1_prompt']} | {r['prompt_tokens']} | {r['cached_tokens']} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
