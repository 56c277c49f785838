"""CacheAdmin: what the server and the CLI may do to a running prompt cache besides using it.

The engine owns its ``PromptCache`` (lookups and saves happen in its steps); everyone else gets
this handle from ``Engine.cache_admin``: deletions across every tier, the RAM budget, the stats,
the start-up warm-up from a tier that can name its hottest prefixes (``WarmSource``). Nothing
here names a tier class: capabilities are checked by protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from promptcache.core.sessions import DeleteReport
from promptcache.core.stats import CacheStats
from promptcache.core.tiers.warm import WarmUp, warm_up

if TYPE_CHECKING:
    from promptcache.core.cache import PromptCache

__all__ = ["CacheAdmin"]


class CacheAdmin:
    def __init__(self, cache: PromptCache) -> None:
        self._cache = cache

    @property
    def ram_budget_bytes(self) -> int:
        return self._cache.ram.budget_bytes

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    def has_tier(self, name: str) -> bool:
        """Whether a tier named ``name`` (``"ssd"``, ``"shared"``) is behind RAM."""
        return self._cache.tiers.find(name) is not None

    def stats(self) -> CacheStats:
        return self._cache.stats()

    def delete_session(self, session: str, tenant: str = "", force: bool = False) -> DeleteReport:
        """The blocks only ``session`` (of ``tenant``) uses, from every tier; shared ones too
        when ``force`` (``PromptCache.delete_session``)."""
        return self._cache.delete_session(session, tenant, force)

    def delete_tenant(self, tenant: str) -> DeleteReport:
        """Every block of ``tenant``'s namespace, from every tier."""
        return self._cache.delete_tenant(tenant)

    def can_warm_up(self) -> bool:
        """Whether a tier behind RAM can name its hottest prefixes (the shared tier)."""
        return self._cache.tiers.warm_source() is not None

    def warm_up(
        self,
        byte_budget: int,
        time_limit_s: float,
        progress: Callable[[str], None] | None = None,
    ) -> WarmUp | None:
        """Before serving: the hottest prefixes of this model in the nearest tier that can name
        them (``WarmSource``: the shared tier) into RAM, within ``byte_budget`` (capped at the
        RAM budget) and ``time_limit_s``; None without such a tier."""
        source = self._cache.tiers.warm_source()
        if source is None:
            return None
        budget = min(byte_budget, self.ram_budget_bytes)
        return warm_up(self._cache, source, budget, time_limit_s, progress)

    # the name the server and the CLI used before tiers were checked by capability
    warm_up_shared = warm_up
