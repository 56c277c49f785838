"""``promptcache serve``: the engine from its flags, the server state, the start-up warm-up of
the shared tier, then uvicorn until a signal. (The flags themselves are in ``cli.main`` and
``cli.flags``.)
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from promptcache.cli.flags import check_format_flags, tier_options_from_args


def default_cache_dir() -> str:
    from promptcache.models import cache_root

    return str(cache_root() / "blocks")


# the serve/bench flags that are build_engine options of the same name
ENGINE_FLAGS = (
    "revision",
    "block_size",
    "ram_budget",
    "prefill_chunk",
    "step_tokens",
    "max_step_tokens",
    "max_live_bytes",
    "max_context",
    "dtype",
    "device",
    "policy",
    "ram_ttl",
    "encrypt_key_file",
    "kv_bits",
    "cache_kv_bits",
    "cache_kv_group",
    "cache_kv_min_tokens",
    "cache_dtype",
    "vision_cache_bytes",
    "threads",
    "weights",
    "compile",
)


def engine_from_args(args: argparse.Namespace) -> Any:
    from promptcache.engines.factory import build_engine

    return build_engine(
        args.engine,
        args.model,
        cache_enabled=not args.no_cache,
        **tier_options_from_args(args),
        **{name: getattr(args, name) for name in ENGINE_FLAGS},
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from promptcache.core.tiers.ssd.lock import CacheDirLockedError
    from promptcache.errors import ConfigError
    from promptcache.server.app import create_app
    from promptcache.server.response_store import ResponseStore
    from promptcache.server.script import ReplyScript
    from promptcache.server.state import ServerState

    if not 0 <= args.hit_rate_alert <= 1 or args.hit_rate_window < 1:
        raise SystemExit("promptcache: --hit-rate-alert must be in [0, 1], --hit-rate-window >= 1")
    script = ReplyScript.load(args.scripted_replies) if args.scripted_replies else None
    check_format_flags(args)
    if args.responses_max < 0 or args.responses_ttl <= 0:
        raise ConfigError("--responses-max must be >= 0 and --responses-ttl > 0")
    if any(n is not None and n < 1 for n in (args.default_max_tokens, args.max_output_tokens)):
        raise ConfigError("--default-max-tokens and --max-output-tokens must be >= 1")
    try:
        engine = engine_from_args(args)
    except CacheDirLockedError as exc:  # another server uses this cache folder
        raise ConfigError(str(exc)) from None
    state = ServerState(
        engine,
        script=script,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        default_max_tokens=args.default_max_tokens,
        max_output_tokens=args.max_output_tokens,
        strict_max_tokens=args.strict_max_tokens,
        responses=ResponseStore(args.responses_max, args.responses_ttl),
        keep_billing_header=args.keep_billing_header,
        limits=limits_from_args(args),
        hit_rate_alert=args.hit_rate_alert,
        hit_rate_window=args.hit_rate_window,
    )
    cache = (
        "off"
        if args.no_cache
        else f"on (block {args.block_size}, {engine.cache_admin.ram_budget_bytes / 1e6:.0f} MB RAM, "
        + (
            "no SSD tier)"
            if args.no_ssd
            else f"SSD tier in {args.cache_dir or default_cache_dir()})"
        )
    )
    logging.getLogger("promptcache").info(
        "serving %s on http://%s:%s, cache %s", state.model_id, args.host, args.port, cache
    )
    print(
        f"promptcache: serving {state.model_id} ({engine.name}) on http://{args.host}:{args.port}  cache {cache}",
        flush=True,
    )
    if not args.no_cache:
        warm_up(engine.cache_admin, args.warmup_bytes, args.warmup_seconds)
    try:
        # on SIGTERM in-flight requests get 5 s, then are cancelled (their generations stop)
        uvicorn.run(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.close()
    return 0


def warm_up(admin: Any, size: str | None, seconds: float) -> None:
    """Before serving: the hottest prefixes of this model in a tier that can name them (the
    shared tier) into RAM (``size``:
    bytes, 512MB or 10%% of the RAM budget; ``seconds``; either 0 disables). ``admin``: the
    engine's ``CacheAdmin`` (None: the cache is off)."""
    from promptcache.core.budget import parse_size
    from promptcache.errors import ConfigError

    if admin is None or not admin.can_warm_up() or not seconds or seconds <= 0:
        return
    budget = admin.ram_budget_bytes
    try:
        nbytes = budget // 10 if size is None else parse_size(size, total_bytes=budget)
    except ValueError as exc:
        raise ConfigError(f"--warmup-bytes: {exc}") from None
    if nbytes <= 0:
        return
    log = logging.getLogger("promptcache")

    def progress(line: str) -> None:
        log.info("%s", line)
        print(f"promptcache: {line}", file=sys.stderr, flush=True)

    admin.warm_up(nbytes, seconds, progress)


# the serve flags that are ``Limits`` fields of the same name
LIMIT_FLAGS = (
    "max_queue",
    "max_body_bytes",
    "max_prompt_tokens",
    "max_stop_strings",
    "allow_image_urls",
    "max_image_bytes",
)


def limits_from_args(args: argparse.Namespace) -> Any:
    from promptcache.server.guard import LOOPBACK_HOSTS, load_api_keys
    from promptcache.server.state import Limits

    keys = load_api_keys(args.api_keys)
    loopback = args.host in LOOPBACK_HOSTS
    if not keys and not loopback:
        logging.getLogger("promptcache").warning(
            "listening on %s WITHOUT API keys: anyone who can reach it can use any tenant's "
            "cache and read every tenant's stats; set --api-keys (see docs/operations.md)",
            args.host,
        )
    return Limits(
        request_timeout_s=args.request_timeout or None,
        api_keys=keys,
        loopback_only=loopback,
        **{name: getattr(args, name) for name in LIMIT_FLAGS},
    )
