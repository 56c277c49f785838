"""The default: follow whichever candidate policy the what-if simulations say is winning.

Every candidate (LRU, S3-FIFO, frecency) tracks every live block all the time, through the same
calls it would get alone; only the choice of victim is delegated, to the current leader, and the
others just drop that block. So a switch needs no warm-up (the new leader already orders the
resident set its own way), and while one leader stays in charge the live cache evicts exactly as
that fixed policy would. The leader is the candidate with the most (recent) hits in its sampled
miniature of the live workload at the live budget (``core/whatif.py``, attached by
``PromptCache``); without one it stays on the first candidate. Why this and not LeCaR-style
regret weights: the issue's bound is against the best *fixed* policy, which following the
measured winner reaches once the winner is clear; mixing orders would match none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from promptcache.core.block import Block
from promptcache.core.policy import EvictionPolicy, make_policy, register_policy

if TYPE_CHECKING:
    from promptcache.core.whatif import WhatIf

CANDIDATES = ("lru", "s3fifo", "frecency")


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, candidate_names: Sequence[str] = CANDIDATES) -> None:
        self.candidate_names = tuple(candidate_names)
        self.candidates: list[EvictionPolicy] = [make_policy(n) for n in self.candidate_names]
        self.whatif: WhatIf | None = None

    @property
    def leader(self) -> int:
        return self.whatif.leader if self.whatif is not None else 0

    def on_insert(self, block: Block) -> None:
        for p in self.candidates:
            p.on_insert(block)

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        for p in self.candidates:
            p.on_access(blocks, is_hit, now)

    def add_evictable(self, block: Block) -> None:
        for p in self.candidates:
            p.add_evictable(block)

    def remove_evictable(self, block: Block) -> None:
        for p in self.candidates:
            p.remove_evictable(block)

    def pop_victim(self) -> Block | None:
        lead = self.leader
        victim = self.candidates[lead].pop_victim()
        if victim is not None:
            for k, p in enumerate(self.candidates):
                if k != lead:
                    p.remove_evictable(victim)
        return victim

    def admit(self, candidate: Block, victim: Block) -> bool:
        return self.candidates[self.leader].admit(candidate, victim)

    def on_evict(self, block: Block) -> None:
        for p in self.candidates:
            p.on_evict(block)

    def check_integrity(self, evictable: set[int]) -> None:
        for p in self.candidates:
            p.check_integrity(evictable)


register_policy("adaptive")(AdaptivePolicy)
