"""Building the prompt cache an engine serves from: its options, the RAM tier, and the lower
tiers the core's factory (``core.tiers.factory.build_tiers``) builds from each registered tier's
options (``tier_options``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promptcache.core.budget import parse_size
from promptcache.core.cache import PromptCache
from promptcache.core.cipher import make_cipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.factory import build_tiers
from promptcache.core.tiers.registry import tier_option_names
from promptcache.core.vision_cache import VisionCache
from promptcache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Serving and cache options shared by every engine (the keyword options of
    ``TorchEngine``/``MlxEngine``). ``cache``: an existing cache to use; else one is built
    (``cache_enabled``) with a RAM tier of ``ram_budget`` and behind it the registered tiers
    ``tier_options`` ask for (``ssd_dir``: the SSD tier, ``shared_url``: the shared tier; see
    ``core.tiers.registry``), or ``next_tier`` as given. ``max_context`` is capped at the
    model's limit. ``of`` takes the tiers' options as keywords beside the others."""

    model_id: str = "model"
    cache: PromptCache | None = None
    cache_enabled: bool = True
    block_size: int = 64
    ram_budget: int | str | None = None
    prefill_chunk: int = 512
    step_tokens: int | None = None  # tokens per engine step (batching.py); None: its default
    max_step_tokens: int | None = None  # the most a step's budget grows to under load
    # the running requests' KV state at most (parse_size); a newcomer past it waits (None: no cap)
    max_live_bytes: int | str | None = None
    max_context: int | None = None
    # the step shapes once before the first request (a runner that ``WarmsUp``): its kernels'
    # working memory counts as the process at start, and the first requests do not build it
    warm_up: bool = True
    next_tier: Any = None
    policy: str | None = None
    # each registered tier's options by name (ssd_dir, ssd_budget, shared_url, ...)
    tier_options: Mapping[str, Any] = field(default_factory=dict)
    ram_ttl: float | None = None  # seconds a RAM block may go unused (None: no expiry)
    encrypt_key_file: str | Path | None = None  # AES-256-GCM key for the tiers' files at rest
    # vision models: encoder outputs kept in RAM (0: no embedding cache), and under ssd_dir
    vision_cache_bytes: int | str = "512MB"
    vision_cache_ssd_bytes: int | str = "2GB"

    @classmethod
    def of(cls, **options: Any) -> EngineOptions:
        """The options from keywords: a registered tier's option (``ssd_dir=``) goes into
        ``tier_options``, the rest are fields (TypeError on a name that is neither)."""
        names = tier_option_names()
        tiers = {**options.pop("tier_options", {})}
        tiers.update({k: options.pop(k) for k in list(options) if k in names})
        return cls(**options, tier_options=tiers)

    @property
    def ssd_dir(self) -> str | Path | None:
        """The SSD tier's folder, if any (the vision-embedding cache keeps its files there)."""
        folder: str | Path | None = self.tier_options.get("ssd_dir")
        return folder

    def check(self) -> None:
        if self.prefill_chunk <= 0:
            raise ConfigError("prefill_chunk must be positive")
        if self.step_tokens is not None and self.step_tokens <= 0:
            raise ConfigError("step_tokens must be positive")
        if self.max_step_tokens is not None and self.max_step_tokens <= 0:
            raise ConfigError("max_step_tokens must be positive")


def build_vision_cache(opts: EngineOptions, codec: PayloadCodec) -> VisionCache | None:
    """The vision-embedding cache ``opts`` ask for (None: off, or the prompt cache is off)."""
    if not opts.cache_enabled:
        return None
    try:
        ram = parse_size(opts.vision_cache_bytes)
        ssd = parse_size(opts.vision_cache_ssd_bytes)
    except ValueError as exc:
        raise ConfigError(f"vision cache: {exc}") from None
    if ram <= 0:
        return None
    # the embeddings on disk stay plaintext-free: with an encryption key they stay in RAM only
    ssd_dir = opts.ssd_dir if opts.encrypt_key_file is None else None
    return VisionCache(ram, ssd_dir=ssd_dir, codec=codec, ssd_budget_bytes=ssd)


def build_cache(
    opts: EngineOptions, fingerprint: str, codec: PayloadCodec, requires_checkpoint: bool
) -> PromptCache | None:
    """The cache ``opts`` ask for, or None when it is off."""
    if opts.cache is not None or not opts.cache_enabled:
        return opts.cache
    next_tier = opts.next_tier
    built: list[BlockStore] = []
    evictions = EvictionLog()  # RAM and every lower tier note evictions here
    if next_tier is None:
        try:
            cipher = make_cipher(opts.encrypt_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--encrypt-key-file: {exc}") from None
        try:
            built = next_tier = build_tiers(
                fingerprint=fingerprint,
                codec=codec,
                evictions=evictions,
                cipher=cipher,
                **opts.tier_options,
            )
        except ValueError as exc:  # a bad budget, a URL that is not a Valkey one
            raise ConfigError(f"lower tiers: {exc}") from None
    try:
        return PromptCache(
            fingerprint,
            block_size=opts.block_size,
            ram_budget=opts.ram_budget,
            ram_ttl=opts.ram_ttl,
            requires_checkpoint=requires_checkpoint,
            next_tier=next_tier,
            policy=opts.policy,
            evictions=evictions,
        )
    except ValueError as exc:  # a bad budget, block size, TTL or policy name
        for tier in built:
            tier.close()  # its folder lock: a retry in this process must find it free
        raise ConfigError(f"prompt cache: {exc}") from None
