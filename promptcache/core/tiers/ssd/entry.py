"""The SSD tier's registration: its options, its flags (``--cache-dir``, ``--ssd-budget``,
``--ssd-retention``, ``--no-ssd``) and its build."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from promptcache.core.budget import parse_size
from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.options import TierAdmin, TierContext, TierEntry, TierFlag

DEFAULT_BUDGET = "10GB"


def _from_flags(values: Mapping[str, Any], home: Path) -> dict[str, Any]:
    folder = None if values.get("no_ssd") else (values.get("cache_dir") or str(home / "blocks"))
    return {
        "ssd_dir": folder,
        "ssd_budget": values.get("ssd_budget", DEFAULT_BUDGET),
        "ssd_retention": values.get("ssd_retention"),
    }


def _build(options: Mapping[str, Any], ctx: TierContext) -> BlockStore | None:
    """An SSD tier under ``ssd_dir`` (None: no SSD tier); raises CacheDirLockedError when
    another process holds the model's folder."""
    if options["ssd_dir"] is None:
        return None
    from promptcache.core.tiers.ssd.tier import SsdTier

    return SsdTier(
        options["ssd_dir"],
        ctx.fingerprint,
        codec=ctx.codec,
        budget_bytes=parse_size(options["ssd_budget"]),
        retention_s=options["ssd_retention"],
        evictions=ctx.evictions,
        cipher=ctx.cipher,
    )


ENTRY = TierEntry(
    name="ssd",
    order=10,
    options={"ssd_dir": None, "ssd_budget": DEFAULT_BUDGET, "ssd_retention": None},
    flags=(
        TierFlag("cache-dir", None, "where the SSD tier keeps block files (default: <user cache dir>/blocks)"),
        TierFlag("ssd-budget", DEFAULT_BUDGET, "SSD tier size, from real file sizes"),
        TierFlag("ssd-retention", None, "drop SSD blocks unused for this many seconds (default: never)", float),
        TierFlag("no-ssd", False, "RAM tier only: nothing persists across restarts", switch=True),
    ),
    from_flags=_from_flags,
    build=_build,
    admin=TierAdmin("cache-dir", "the SSD tier: the serve --cache-dir (default: <user cache dir>/blocks)",
                    "promptcache.cli.cache:run_cache_command", is_default=True),
)  # fmt: skip
