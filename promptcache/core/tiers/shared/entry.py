"""The shared tier's registration: its options, its flags (``--shared-tier``,
``--shared-ttl``) and its build (valkey-py is imported only when one is asked for)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from promptcache.core.tiers.base import BlockStore
from promptcache.core.tiers.options import TierAdmin, TierContext, TierEntry, TierFlag


def _from_flags(values: Mapping[str, Any], home: Path) -> dict[str, Any]:
    return {"shared_url": values.get("shared_tier"), "shared_ttl": values.get("shared_ttl")}


def _build(options: Mapping[str, Any], ctx: TierContext) -> BlockStore | None:
    """The shared tier on the Valkey server at ``shared_url`` (None: none), entries living
    ``shared_ttl`` seconds; ValueError on a URL that is not a Valkey one. An unreachable server
    is not an error: the tier connects when it can."""
    url, ttl = options["shared_url"], options["shared_ttl"]
    if not url:
        return None
    if ttl is not None and ttl <= 0:
        raise ValueError(f"shared tier TTL must be positive, got {ttl}")
    from promptcache.core.tiers.shared.store import ValkeyStore  # needs valkey-py

    kw: dict[str, Any] = {} if ttl is None else {"ttl_s": float(ttl)}
    return ValkeyStore(url, ctx.fingerprint, codec=ctx.codec, evictions=ctx.evictions, **kw)


ENTRY = TierEntry(
    name="shared",
    order=20,
    options={"shared_url": None, "shared_ttl": None},
    flags=(
        TierFlag(
            "shared-tier",
            None,
            "shared tier behind SSD, on a Valkey/Redis server several servers share: "
            "valkey://host:port/db (redis://...; ?cluster=1 for cluster mode) (default: none)",
        ),
        TierFlag(
            "shared-ttl", None, "seconds an unused block lives in the shared tier (default: 86400)", float
        ),
    ),
    from_flags=_from_flags,
    build=_build,
    admin=TierAdmin("shared-tier", "the shared tier on this server (valkey://host:port/db) instead of the SSD folder",
                    "promptcache.cli.shared:run_shared_command"),
)  # fmt: skip
