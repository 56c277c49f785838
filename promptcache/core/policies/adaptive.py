"""The default: the live cache follows whichever candidate policy is winning in the what-if
simulations of the live workload.

The what-if simulations (``core/whatif.py``, attached by ``PromptCache``) run every candidate
(LRU, S3-FIFO, frecency) on a hash-sampled miniature of the live request stream at the live
budget; the leader is the one with the most recent hits, switching only past a noise margin.
The live cache runs the leader alone, unchanged, so while one leader stays in charge it evicts
exactly as that fixed policy would, at that policy's speed. On a switch the new leader adopts
the resident blocks (``EvictionPolicy.adopt``: recency and hit counts are on every block), and
its decisions match its fixed self again within about one cache turnover.

Why this: the bound to meet is the best *fixed* policy on each workload, which following the
measured winner reaches once the winner is clear and stays within the sims' noise when the
candidates are close; regret-weighted mixing (LeCaR, Cacheus) evicts by an order none of the
candidates would, and tracking every candidate on the live cache would cost each one's upkeep.
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
        self.current = 0  # index of the candidate in charge
        self.policy: EvictionPolicy = make_policy(self.candidate_names[0])
        self.whatif: WhatIf | None = None
        # every resident block, for a hand-over (insertion order; sorted by recency then)
        self._resident: dict[Block, None] = {}

    def _follow(self) -> EvictionPolicy:
        """The policy in charge, after handing over if the simulations changed their leader."""
        if self.whatif is not None and self.whatif.leader != self.current:
            self.current = self.whatif.leader
            self.policy = make_policy(self.candidate_names[self.current])
            self.policy.adopt(sorted(self._resident, key=lambda b: b.last_access))
        return self.policy

    def on_insert(self, block: Block) -> None:
        self._resident[block] = None
        self.policy.on_insert(block)

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        self.policy.on_access(blocks, is_hit, now)

    def add_evictable(self, block: Block) -> None:
        self.policy.add_evictable(block)

    def remove_evictable(self, block: Block) -> None:
        self.policy.remove_evictable(block)

    def pop_victim(self) -> Block | None:
        return self._follow().pop_victim()

    def admit(self, candidate: Block, victim: Block) -> bool:
        return self.policy.admit(candidate, victim)

    def on_evict(self, block: Block) -> None:
        if self._resident.pop(block, 0) is None:
            self.policy.on_evict(block)

    def adopt(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            self._resident[b] = None
        self.policy.adopt(blocks)

    def check_integrity(self, evictable: set[int]) -> None:
        self.policy.check_integrity(evictable)


register_policy("adaptive")(AdaptivePolicy)
