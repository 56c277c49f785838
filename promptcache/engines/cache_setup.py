"""Building the prompt cache an engine serves from: its options, the RAM tier and, with a
cache folder, the SSD tier behind it. The SSD tier's construction is isolated in ``ssd_tier``
so that it can move to a core factory without touching the engines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptcache.core.budget import parse_size
from promptcache.core.cache import PromptCache
from promptcache.core.codec import PayloadCodec
from promptcache.core.ssd_tier import SsdTier
from promptcache.engines.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Serving and cache options shared by every engine (the keyword options of
    ``TorchEngine``/``MlxEngine``). ``cache``: an existing cache to use; else one is built
    (``cache_enabled``) with a RAM tier of ``ram_budget`` and, with ``ssd_dir``, an SSD tier
    behind it (or ``next_tier`` as given). ``max_context`` is capped at the model's limit."""

    model_id: str = "model"
    cache: PromptCache | None = None
    cache_enabled: bool = True
    block_size: int = 64
    ram_budget: int | str | None = None
    prefill_chunk: int = 512
    step_tokens: int | None = None  # tokens per engine step (batching.py); None: its default
    max_context: int | None = None
    next_tier: Any = None
    policy: str | None = None
    ssd_dir: str | Path | None = None
    ssd_budget: int | str = "10GB"
    ssd_retention: float | None = None

    def check(self) -> None:
        if self.prefill_chunk <= 0:
            raise ConfigError("prefill_chunk must be positive")
        if self.step_tokens is not None and self.step_tokens <= 0:
            raise ConfigError("step_tokens must be positive")


def ssd_tier(
    ssd_dir: str | Path,
    fingerprint: str,
    codec: PayloadCodec,
    budget: int | str,
    retention_s: float | None,
) -> SsdTier:
    """The SSD tier for one model's blocks (raises CacheDirLockedError when another process
    holds the model's folder)."""
    try:
        budget_bytes = parse_size(budget)
    except ValueError as exc:
        raise ConfigError(f"ssd budget: {exc}") from None
    return SsdTier(
        ssd_dir, fingerprint, codec=codec, budget_bytes=budget_bytes, retention_s=retention_s
    )


def build_cache(
    opts: EngineOptions, fingerprint: str, codec: PayloadCodec, requires_checkpoint: bool
) -> PromptCache | None:
    """The cache ``opts`` ask for, or None when it is off."""
    if opts.cache is not None or not opts.cache_enabled:
        return opts.cache
    next_tier = opts.next_tier
    built = None
    if next_tier is None and opts.ssd_dir is not None:
        built = next_tier = ssd_tier(
            opts.ssd_dir, fingerprint, codec, opts.ssd_budget, opts.ssd_retention
        )
    try:
        return PromptCache(
            fingerprint,
            block_size=opts.block_size,
            ram_budget=opts.ram_budget,
            requires_checkpoint=requires_checkpoint,
            next_tier=next_tier,
            policy=opts.policy,
        )
    except ValueError as exc:  # a bad budget, block size or policy name
        if built is not None:
            built.close()  # its folder lock: a retry in this process must find it free
        raise ConfigError(f"prompt cache: {exc}") from None
