"""What a lookup hands out (``Lease``: pinned blocks until released) and what a save returns."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from promptcache.core.block import Block
from promptcache.core.stats import LookupReport


class _Releases(Protocol):
    def _release(self, lease: Lease) -> None:
        """Unpin ``lease.blocks`` and set ``is_released``, once, under the cache's lock."""


class SaveResult(NamedTuple):
    num_new_blocks: int
    num_new_bytes: int
    num_cached_tokens: int  # tokens of the saved sequence resident after the save


class Lease:
    """A lookup result whose blocks stay pinned until ``release()`` (idempotent) or context exit."""

    __slots__ = ("num_tokens", "blocks", "kind", "checkpoint", "report", "_cache", "is_released")

    def __init__(
        self,
        cache: _Releases,
        num_tokens: int,
        blocks: tuple[Block, ...],
        kind: str,
        report: LookupReport | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.blocks = blocks
        self.kind = kind
        self.report = report  # what the lookup found, for the request's cache record
        # snapshot state at num_tokens: only set when the hit ends exactly at a checkpoint
        last = blocks[-1] if blocks else None
        self.checkpoint = last.checkpoint if last is not None and last.end == num_tokens else None
        self._cache = cache
        self.is_released = not blocks  # set by the cache, under its lock

    def segments(self) -> list[tuple[Any, int]]:
        """(positional payload, tokens to take from its start) per block, covering [0, num_tokens)."""
        out = []
        for blk in self.blocks:
            out.append((blk.payload, min(blk.num_tokens, self.num_tokens - blk.depth)))
        return out

    def release(self) -> None:
        """Unpin the blocks; safe to call twice and from several threads at once."""
        if not self.is_released:
            self._cache._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
