"""Command line: ``promptcache serve | bench | replay | cache | models``.

Every serve flag has an environment variable: --ram-budget is PROMPTCACHE_RAM_BUDGET, and so on.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from promptcache.cli.flags import (
    add_engine_flags,
    add_flag,
    add_format_flags,
    add_switch,
)
from promptcache.cli.serve import cmd_serve
from promptcache.core.tiers.registry import tier_entries


def cmd_bench(args: argparse.Namespace) -> int:
    from promptcache.cli.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="promptcache", description="LLM inference server with a prompt cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
    add_flag(serve, "host", "127.0.0.1", "address to listen on")
    add_flag(serve, "port", 8000, "port to listen on", int)
    add_flag(serve, "log-level", "info", "uvicorn log level")
    add_flag(
        serve,
        "max-output-tokens",
        None,
        "at most this many generated tokens per request, whatever max_tokens asks (default: "
        "the room left in the context)",
        int,
    )
    add_flag(
        serve,
        "default-max-tokens",
        None,
        "generated tokens per request that names no limit (max_tokens, max_output_tokens, "
        "num_predict) (default: until the context is full, as llama.cpp and Ollama do)",
        int,
    )
    add_switch(
        serve,
        "strict-max-tokens",
        "refuse (400 context_length_exceeded) a max_tokens larger than the room the prompt "
        "leaves in the context (default: clamped to the room, said in the "
        "x-promptcache-max-tokens-clamped header)",
    )
    add_flag(
        serve,
        "responses-max",
        1000,
        "stored Responses API responses kept per tenant (oldest go first; 0: none kept, so "
        "previous_response_id never continues)",
        int,
    )
    add_flag(serve, "responses-ttl", 86400.0, "seconds a stored response is kept", float)
    add_flag(
        serve,
        "hit-rate-alert",
        0.8,
        "warn (log, /metrics gauge, dashboard banner) when the token hit rate over the last "
        "--hit-rate-window requests is under this fraction (0 turns it off)",
        float,
    )
    add_flag(
        serve,
        "warmup-bytes",
        None,
        "with --shared-tier: pull up to this much of the shared tier's hottest prefixes into "
        "RAM at start-up: bytes, 512MB or a %% of the RAM budget; 0 disables (default: 10%%)",
    )
    add_flag(
        serve,
        "warmup-seconds",
        10.0,
        "with --shared-tier: time limit of the start-up warm-up; 0 disables",
        float,
    )
    add_flag(
        serve,
        "scripted-replies",
        None,
        "for testing clients: a JSON file of replies the model emits instead of its own (each "
        "chosen by turn, a regex on the last message and the tools offered; see docs/clients.md)",
    )
    add_flag(serve, "hit-rate-window", 50, "requests the hit-rate alert looks back over", int)
    add_format_flags(serve)
    add_switch(
        serve,
        "keep-billing-header",
        "keep Claude Code's per-session x-anthropic-billing-header system block in the "
        "prompt (default: dropped, so sessions share their prefix)",
    )
    add_flag(
        serve,
        "api-keys",
        None,
        "file of `KEY TENANT [admin]` lines: every request needs a "
        "key and its tenant comes from the key (also PROMPTCACHE_API_KEYS=KEY=TENANT[:admin],...)",
    )
    add_flag(
        serve, "max-queue", 32, "requests running or waiting for the engine; more get 429", int
    )
    add_flag(
        serve,
        "request-timeout",
        900.0,
        "seconds a request may take from arrival to its last token (0: none)",
        float,
    )
    add_flag(serve, "max-body-bytes", 16 * 2**20, "largest request body accepted (413 above)", int)
    add_flag(
        serve, "max-prompt-tokens", None, "prompt tokens per request (default: the context)", int
    )
    add_flag(serve, "max-stop-strings", 16, "stop strings per request (each up to 512 chars)", int)
    add_flag(serve, "max-image-bytes", 20 * 2**20, "largest image accepted, encoded", int)
    add_switch(
        serve,
        "allow-image-urls",
        "fetch http(s) image URLs (default: only inline base64 images; a URL is a 400)",
    )
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="multi-turn TTFT benchmark: cache on vs off vs ideal")
    add_engine_flags(bench)
    bench.add_argument(
        "--conversation",
        help="a tau-bench trajectory file (JSON); default: a built-in synthetic one",
    )
    bench.add_argument("--turns", type=int, default=8, help="turns to run (default 8)")
    bench.add_argument(
        "--index", type=int, default=0, help="which trajectory of the file (default 0)"
    )
    bench.add_argument(
        "--max-tokens", type=int, default=32, help="reply tokens per turn (default 32)"
    )
    bench.add_argument(
        "--repeats", type=int, default=3, help="runs per mode; medians are reported (default 3)"
    )
    bench.add_argument(
        "--out", default="bench-out", help="folder for the PNG plot and JSON (default bench-out)"
    )
    bench.set_defaults(func=cmd_bench)
    replay = sub.add_parser(
        "replay", help="replay a Mooncake-format trace through the real cache core"
    )
    replay.add_argument("trace", help="JSONL: timestamp, input_length, output_length, hash_ids")
    replay.add_argument(
        "--capacity-tokens",
        type=_tokens,
        required=True,
        help="RAM tier capacity in tokens (3.1M, 500K or 3100000)",
    )
    replay.add_argument(
        "--policy", default=None, help="eviction policy (default: the best built in)"
    )
    replay.add_argument(
        "--block-size", type=int, default=512, help="cache block size in tokens (default 512)"
    )
    replay.add_argument(
        "--trace-block-tokens", type=int, default=512, help="tokens per trace hash id (default 512)"
    )
    replay.add_argument(
        "--with-output", action="store_true", help="also save output_length generated tokens"
    )
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.set_defaults(func=cmd_replay)

    cache = sub.add_parser(
        "cache",
        help="inspect or maintain the SSD or shared tier: stats | ls | verify | clear | delete",
    )
    cache.add_argument("action", choices=("stats", "ls", "sessions", "verify", "clear", "delete"))
    cache.add_argument(
        "--session", default=None, help="delete: the session whose blocks go (inside --tenant)"
    )
    cache.add_argument(
        "--tenant",
        default=None,
        help="delete: the session's tenant (default: none); without --session, the whole tenant",
    )
    cache.add_argument(
        "--force", action="store_true", help="delete: blocks shared with other sessions too"
    )
    cache.add_argument(
        "--encrypt-key-file",
        default=os.environ.get("PROMPTCACHE_ENCRYPT_KEY_FILE"),
        help="verify, delete: the serve --encrypt-key-file of an encrypted cache",
    )
    cache.add_argument(
        "--limit", type=int, default=50, help="ls: at most this many blocks per model"
    )
    for entry in tier_entries():  # each tier with an offline command: the flag that picks it
        if entry.admin is not None:
            cache.add_argument(f"--{entry.admin.flag}", default=None, help=entry.admin.help)
    cache.set_defaults(func=cmd_cache)

    models = sub.add_parser(
        "models",
        help="list the models found locally (HF cache, LM Studio, bundled): size, engine, "
        "whether they can be served",
    )
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(func=cmd_models)
    return parser


def cmd_models(args: argparse.Namespace) -> int:
    from promptcache.cli.models import run_models_command

    return run_models_command(args)


def cmd_cache(args: argparse.Namespace) -> int:
    """The offline command of the tier whose flag was given (the default tier's without one)."""
    admins = [e.admin for e in tier_entries() if e.admin is not None]
    given = [a for a in admins if getattr(args, a.flag.replace("-", "_")) is not None]
    if len(given) > 1:
        print(f"promptcache cache: give one of {', '.join('--' + a.flag for a in given)}")
        return 2
    picked = given or [a for a in admins if a.is_default]
    if not picked:
        print(f"promptcache cache: give one of {', '.join('--' + a.flag for a in admins)}")
        return 2
    module, _, function = picked[0].command.partition(":")
    run: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), function)
    return run(args)


def _tokens(text: str) -> int:
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("capacity must be positive")
    return value


def cmd_replay(args: argparse.Namespace) -> int:
    from promptcache.cli.replay import cmd_replay as run

    return run(args)


EXIT_CONFIG = 2  # the command cannot start as configured (the message says why)


def main(argv: Sequence[str] | None = None) -> int:
    from promptcache.errors import ConfigError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:  # a start-up failure, not a crash: the reason, no traceback
        print(f"promptcache: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
