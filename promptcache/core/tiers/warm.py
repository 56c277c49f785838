"""Start-up warm-up: a new server pulls a tier's hottest prefixes into RAM before its first
request. Any store that can name them (``base.WarmSource``: the shared tier) can be the source."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from promptcache.core.tiers.base import BlockStore, WarmSource

if TYPE_CHECKING:
    from promptcache.core.cache import PromptCache

WARM_BATCH = 32  # blocks per read (one round trip on the shared tier)


class WarmUp(NamedTuple):
    num_blocks: int  # inserted into RAM
    num_bytes: int  # RAM bytes they took
    num_listed: int  # blocks the hottest prefixes named
    seconds: float


def warm_up(
    cache: PromptCache,
    store: BlockStore,
    byte_budget: int,
    time_limit_s: float,
    progress: Callable[[str], None] | None = None,
) -> WarmUp:
    """Pull ``store``'s hottest prefixes (``WarmSource.hottest_blocks``) into ``cache``'s RAM,
    parent first, in batches of verified reads (``PromptCache.warm``), within ``byte_budget``
    stored bytes and ``time_limit_s`` (the RAM budget holds as ever); ``progress`` gets a line
    about once a second and at the end. Counted by the store (``note_warmed``)."""
    assert isinstance(store, WarmSource), f"tier {store.name!r} cannot name its hottest blocks"
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    listed = store.hottest_blocks(byte_budget, time_limit_s) if byte_budget > 0 else []
    done = 0
    before = cache.ram.used_bytes()
    shown = t0
    for i in range(0, len(listed), WARM_BATCH):
        if time.monotonic() > deadline:
            break
        done += cache.warm(store, listed[i : i + WARM_BATCH])
        nbytes = cache.ram.used_bytes() - before  # start-up: nothing else fills RAM meanwhile
        if progress is not None and time.monotonic() - shown >= 1.0:
            shown = time.monotonic()
            progress(f"warm-up: {done}/{len(listed)} blocks, {nbytes / 1e6:.1f} MB")
    nbytes = max(0, cache.ram.used_bytes() - before)
    out = WarmUp(done, nbytes, len(listed), time.monotonic() - t0)
    store.note_warmed(done, nbytes)
    if progress is not None:
        progress(
            f"warm-up: {done} of {len(listed)} blocks ({nbytes / 1e6:.1f} MB) from the "
            f"{store.name} tier into RAM in {out.seconds:.1f} s"
        )
    return out
