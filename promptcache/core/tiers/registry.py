"""The tier registry: every tier behind RAM by name (``options.TierEntry``), so the factory,
``EngineOptions`` and the CLI loop over what is registered instead of naming tiers.

A built-in tier is one package under ``core/tiers/`` with an ``entry`` module defining
``ENTRY``, named once in ``BUILTIN``; another (a plug-in) calls ``register_tier``.
"""

from __future__ import annotations

import importlib

from promptcache.core.tiers.options import TierEntry

__all__ = ["BUILTIN", "register_tier", "tier_entries", "tier_option_names"]

# the built-in tiers' entry modules (each light: the tier itself is imported by its build)
BUILTIN = ("promptcache.core.tiers.ssd.entry", "promptcache.core.tiers.shared.entry")

_ENTRIES: dict[str, TierEntry] = {}
_loaded = False


def register_tier(entry: TierEntry) -> None:
    """Add (or replace) the tier ``entry.name``; its option names must be its own."""
    taken = {o for e in _ENTRIES.values() if e.name != entry.name for o in e.options}
    clash = taken & set(entry.options)
    if clash:
        raise ValueError(f"tier {entry.name!r}: options {sorted(clash)} belong to another tier")
    _ENTRIES[entry.name] = entry


def tier_entries() -> list[TierEntry]:
    """Every registered tier, nearest to RAM first."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            entry = importlib.import_module(module).ENTRY
            if entry.name not in _ENTRIES:
                register_tier(entry)
    return sorted(_ENTRIES.values(), key=lambda e: (e.order, e.name))


def tier_option_names() -> set[str]:
    """Every registered tier's option names (``EngineOptions`` routes them to the tiers)."""
    return {o for e in tier_entries() for o in e.options}
