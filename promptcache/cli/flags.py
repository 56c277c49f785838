"""The flags the commands share: each with a ``PROMPTCACHE_*`` environment variable (--ram-budget
is PROMPTCACHE_RAM_BUDGET), and the engine and cache flags of ``serve`` and ``bench`` (each
registered tier's own flags among them: ``add_tier_flags``)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_value(name: str, default: Any) -> Any:
    return os.environ.get("PROMPTCACHE_" + name.upper().replace("-", "_"), default)


def add_flag(
    p: argparse.ArgumentParser, name: str, default: Any, help: str, type: Any = str
) -> None:
    env = "PROMPTCACHE_" + name.upper().replace("-", "_")
    value = env_value(name, default)
    p.add_argument(
        "--" + name,
        default=type(value) if value is not None else None,
        type=type,
        help=f"{help} [env {env}; default {default}]",
    )


def add_switch(p: argparse.ArgumentParser, name: str, help: str) -> None:
    """A ``store_true`` flag whose environment variable set to 1/true/yes turns it on."""
    env = "PROMPTCACHE_" + name.upper().replace("-", "_")
    default = str(env_value(name, "")).lower() in ("1", "true", "yes")
    p.add_argument("--" + name, action="store_true", default=default, help=f"{help} [env {env}]")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "model",
        None,
        "an HF hub id (org/name: from the HF cache, else LM Studio's models folder, else "
        "downloaded), an HF-format folder or a .gguf file (default: bundled "
        "SmolLM2-135M-Instruct); `promptcache models` lists what this machine has",
    )
    add_flag(
        p,
        "revision",
        None,
        "with a hub id: the branch, tag or commit to serve (default: main)",
    )
    add_flag(p, "engine", "auto", "auto | torch | mlx")
    add_flag(
        p,
        "threads",
        None,
        "torch intra-op threads; 0: torch's default (one per core) (default: OMP_NUM_THREADS "
        "if set, else auto: the cores other processes leave free, at start from the load "
        "average, then re-checked every 2 s)",
        int,
    )
    add_flag(
        p,
        "ram-ttl",
        None,
        "drop RAM blocks unused for this many seconds (a request's cache_control TTL hint "
        "overrides it for its blocks) (default: never; eviction only)",
        float,
    )
    add_flag(
        p,
        "encrypt-key-file",
        None,
        "encrypt SSD block files and the token ids in their index with AES-256-GCM under the "
        "32-byte key in this file (raw, hex or base64); the key is never written by us",
    )
    add_flag(
        p,
        "ram-budget",
        None,
        "RAM tier size: bytes, 512MB, 4GiB or 20%% (default 20%% of available RAM, >=100 MB)",
    )
    add_flag(p, "block-size", 64, "tokens per cache block", int)
    add_flag(
        p,
        "prefill-chunk",
        512,
        "tokens per prefill chunk (the cache saves at each chunk boundary)",
        int,
    )
    add_flag(
        p,
        "step-tokens",
        None,
        "tokens per engine step (continuous batching). A step runs prefill first, shortest "
        "prompt first, in what the decode tokens leave of the budget (a request arriving during "
        "a step is looked up and prefilled in the next one, and its first token streams before "
        "that step's decode forward), then every decoding request's next token in one forward; "
        "a smaller budget means shorter steps (newcomers wait less, decoding streams pause less) "
        "and slower long prefills (default 128; under load a step's budget grows to 1.5x this "
        "per request in the step, at most --max-step-tokens: many sessions spend fewer decode "
        "forwards per prefilled token)",
        int,
    )
    add_flag(
        p,
        "max-step-tokens",
        None,
        "the most a step's token budget grows to under load (default 512): lower means "
        "shorter steps under many sessions (a newcomer's first token waits less), higher means "
        "fewer decode forwards per prefilled token",
        int,
    )
    add_flag(
        p,
        "max-live-bytes",
        None,
        "the running requests' KV state at most (e.g. 2GB): a new request whose prompt would "
        "pass it waits in the queue until running ones finish (one request always runs); "
        "off for no cap (default: 80%% of the memory left at start, the RAM tier's budget and "
        "a container's limit counted)",
        str,
    )
    add_flag(
        p,
        "max-context",
        None,
        "context window in tokens: refuse longer prompts; above the model's native context, "
        "extend it by YaRN RoPE scaling (RoPE models only; others exit with the reason) "
        "(default: the model's)",
        int,
    )
    add_flag(p, "dtype", "float32", "model dtype: float32 | bfloat16 | float16")
    add_flag(
        p,
        "weights",
        None,
        "torch engine, CPU: run the linear layers on int8 or int4 weights (weight-only, "
        "torch's packed kernels; a separate cache fingerprint) (default: the model's dtype)",
    )
    add_flag(p, "device", "cpu", "torch device: cpu | cuda")
    add_switch(
        p,
        "compile",
        "torch engine: compile the decode step with torch.compile (inductor) at start-up (a "
        "minute or more, logged): fewer, fused kernels per token; logits differ from eager by "
        "float rounding",
    )
    add_flag(
        p, "kv-bits", None, "mlx engine: quantize the KV cache to 2-8 bits (default: full)", int
    )
    add_flag(
        p,
        "cache-kv-bits",
        None,
        "store cached K/V blocks quantized to 8 or 4 bits (RAM, SSD; restored dequantized)",
        int,
    )
    add_flag(
        p,
        "cache-kv-group",
        64,
        "values per scale (4-bit: scale and minimum) along the head dim (--cache-kv-bits)",
        int,
    )
    add_flag(
        p,
        "cache-kv-min-tokens",
        0,
        "blocks starting before this position stay full precision (--cache-kv-bits)",
        int,
    )
    add_flag(p, "cache-dtype", None, "store a float32 model's cached blocks as: bfloat16")
    add_flag(p, "policy", None, "RAM tier eviction policy (default: the best built in)")
    add_flag(
        p,
        "vision-cache-bytes",
        "512MB",
        "vision models: image encoder outputs kept in RAM (also on SSD); 0 turns it off",
    )
    add_switch(p, "no-cache", "serve with the prompt cache off (A/B runs)")
    add_tier_flags(p)


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """Every registered tier's flags (``core.tiers.registry``), nearest tier first."""
    from promptcache.core.tiers.registry import tier_entries

    for entry in tier_entries():
        for flag in entry.flags:
            if flag.switch:
                add_switch(p, flag.name, flag.help)
            else:
                add_flag(p, flag.name, flag.default, flag.help, flag.type)


def tier_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every registered tier's options from its parsed flags (``TierEntry.from_flags``;
    folders default under the user cache folder)."""
    from promptcache.core.tiers.registry import tier_entries
    from promptcache.models import cache_root

    values = vars(args)
    options: dict[str, Any] = {}
    for entry in tier_entries():
        mine = {f.dest: values.get(f.dest, f.default) for f in entry.flags}
        options.update(entry.from_flags(mine, cache_root()))
    return options


def add_format_flags(p: argparse.ArgumentParser) -> None:
    """--tool-parser and --reasoning-parser: override the formats detected from the model."""
    from promptcache.tools import parser_names, reasoning_names

    add_flag(
        p,
        "tool-parser",
        None,
        "tool-call format the model writes, overriding detection (chat template markers, "
        f"tokenizer tokens, model_type): {', '.join(parser_names())}",
    )
    add_flag(
        p,
        "reasoning-parser",
        None,
        f"reasoning format, overriding detection: {', '.join(reasoning_names())}",
    )


def check_format_flags(args: argparse.Namespace) -> None:
    """ConfigError (exit 2) for an unknown --tool-parser or --reasoning-parser name."""
    from promptcache.errors import ConfigError
    from promptcache.tools import make_parser, make_reasoning

    try:
        if getattr(args, "tool_parser", None):
            make_parser(args.tool_parser)
        if getattr(args, "reasoning_parser", None):
            make_reasoning(args.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(
            f"--{'tool' if 'tool-call' in str(exc) else 'reasoning'}-parser: {exc}"
        ) from None
