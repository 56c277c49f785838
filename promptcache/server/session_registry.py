"""Everything that holds a session's data, in one place: deleting a session (or a tenant) goes
through ``SessionRegistry`` and reaches each holder once.

The cached blocks come first, through the engine's ``CacheAdmin`` (its ``TierStack`` fans the
deletion out to every tier, RAM first) with their per-tier report; then every ``SessionHolder``
the server registered: the prompts kept for miss diagnosis, the replies kept for continuity,
the request records (their miss details quote prompt text), the stored Responses API responses,
the images' encoder outputs. A new holder registers once (``ServerState`` builds the registry)
and is forgotten with the rest; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from promptcache.core.admin import CacheAdmin
from promptcache.core.sessions import DeleteReport


class SessionHolder(Protocol):
    """Something keeping data of a tenant's sessions besides the cached blocks."""

    @property
    def name(self) -> str:
        """The key of its count in a deletion's "forgotten"."""
        ...

    def forget(self, tenant: str, session: str | None, force: bool, /) -> int:
        """Drop ``session``'s data (None: the whole tenant's); what another session shares
        stays unless ``force``. Returns how many entries went; safe to call twice."""
        ...


@dataclass(frozen=True, slots=True)
class CallHolder:
    """A holder made of a name and a forget function (a holder owned by the engine)."""

    name: str
    forget_fn: Callable[[str, str | None, bool], int]

    def forget(self, tenant: str, session: str | None, force: bool, /) -> int:
        return self.forget_fn(tenant, session, force)


@dataclass(slots=True)
class Deletion:
    """What a deletion removed: the blocks per tier, and each holder's count."""

    blocks: DeleteReport
    forgotten: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {**self.blocks.to_dict(), "forgotten": self.forgotten}


@dataclass(slots=True)
class SessionRegistry:
    """The block tiers (``blocks``: None when the cache is off) and the registered holders."""

    blocks: CacheAdmin | None = None
    holders: list[SessionHolder] = field(default_factory=list)

    def register(self, holder: SessionHolder) -> None:
        if any(h.name == holder.name for h in self.holders):
            raise ValueError(f"a session holder named {holder.name!r} is already registered")
        self.holders.append(holder)

    def forget(self, tenant: str, session: str | None, force: bool = False) -> dict[str, int]:
        """Every holder's data of ``session`` (None: of the tenant), in registration order."""
        return {h.name: h.forget(tenant, session, force) for h in self.holders}

    def delete(self, tenant: str, session: str | None, force: bool = False) -> Deletion:
        """The session's blocks (None: the tenant's namespace) in every tier, then every
        holder's data of it. Blocking (tiers on disk and on the network): run it on a thread."""
        assert self.blocks is not None, "the prompt cache is off: no blocks to delete"
        if session is None:  # a whole tenant: nothing is shared with anyone left
            force = True
            report = self.blocks.delete_tenant(tenant)
        else:
            report = self.blocks.delete_session(session, tenant, force)
        return Deletion(report, self.forget(tenant, session, force))
