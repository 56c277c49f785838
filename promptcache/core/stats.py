"""Cache counters and the immutable snapshot the server exposes."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from promptcache.core.evictions import Eviction
from promptcache.core.figures import Series, Snapshot, counter, field_series, gauge, meta
from promptcache.core.tree import HIT_KINDS


@dataclass(slots=True)
class Counters:
    """Mutable counters; only touched under the cache lock."""

    num_lookups: int = 0
    num_hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hits_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_KINDS, 0))
    num_saves: int = 0
    num_saved_blocks: int = 0
    num_saved_checkpoints: int = 0
    num_save_skipped_blocks: int = 0  # no room: everything else pinned, or admission refused
    num_evictions: int = 0
    num_spills: int = 0
    num_superseded: int = 0  # partial blocks dropped because a full block now covers them
    num_expired: int = 0  # RAM blocks unused past their TTL (--ram-ttl or a request's hint)
    num_deleted: int = 0  # RAM blocks removed by a session or tenant deletion

    def snapshot(self) -> dict[str, Any]:
        """Every counter by name, copied (later counting leaves it as it is): each is a
        ``CacheStats`` field of the same name."""
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}


class LookupReport(NamedTuple):
    """What one lookup found, for the request's cache record and its miss reason."""

    num_tokens: int  # reused
    kind: str  # one of HIT_KINDS, or "miss"
    num_matched: int  # raw common prefix with the cache, before checkpoint and last-token caps
    tokens_by_tier: dict[str, int]  # reused tokens by the tier they were found in
    num_damaged: int  # blocks that failed their checks on the way in (quarantined)
    requires_checkpoint: bool  # snapshot layers: a hit ends only where a checkpoint was saved
    evicted: Eviction | None  # the first block past the match, if the eviction log knows it


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_lookups: int = field(metadata=meta("counter"))
    num_hits: int = field(metadata=meta("counter"))
    lookup_tokens: int = field(metadata=meta("counter"))
    hit_tokens: int = field(metadata=meta("counter"))
    hits_by_kind: dict[str, int] = field(metadata=meta("counter", "kind"))
    num_saves: int = field(metadata=meta("counter"))
    num_saved_blocks: int = field(metadata=meta("counter"))
    num_saved_checkpoints: int = field(metadata=meta("counter"))
    num_save_skipped_blocks: int = field(metadata=meta("counter"))
    num_evictions: int = field(metadata=meta("counter"))
    num_spills: int = field(metadata=meta("counter"))
    num_superseded: int = field(metadata=meta("counter"))
    num_blocks: int = field(metadata=meta("gauge"))
    num_pinned_blocks: int = field(metadata=meta("gauge"))
    bytes_by_tier: dict[str, int] = field(metadata=meta("gauge", "tier"))
    ram_budget_bytes: int = field(metadata=meta("gauge"))
    # lower tiers' own figures by name (the SSD tier's, the shared tier's)
    tiers: dict[str, Snapshot] = field()
    block_size: int = field()
    policy: str = field()
    # the adaptive policy's what-if simulations: leader, hit rate by budget factor and policy
    whatif: Snapshot | None = None
    num_expired: int = counter(0)
    num_deleted: int = counter(0)
    ram_ttl_s: float | None = gauge(None)

    @property
    def hit_rate(self) -> float:
        """Token-weighted: prompt tokens served from cache / prompt tokens looked up."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.hit_tokens

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tiers"] = {name: t.to_dict() for name, t in self.tiers.items()}
        whatif = out.pop("whatif")
        out.update(whatif.to_dict() if whatif is not None else {})  # flat: policy_leader, ...
        out["hit_rate"] = round(self.hit_rate, 6)
        out["tokens_saved"] = self.tokens_saved
        return copy.deepcopy(out)

    def series(self) -> list[Series]:
        out = field_series(CacheStats, {f.name: getattr(self, f.name) for f in fields(self)})
        out += [
            Series("hit_rate", "gauge", round(self.hit_rate, 6)),
            Series("tokens_saved", "counter", self.tokens_saved),
        ]
        if self.whatif is not None:
            out += self.whatif.series()
        for name, tier in self.tiers.items():
            out += [s.renamed(f"{name}_") for s in tier.series()]
        return out
