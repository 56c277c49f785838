"""The default: the live cache follows whichever candidate policy is winning in the what-if
simulations of the live workload.

The what-if simulations (``core/whatif.py``, attached by ``PromptCache``) run every candidate
(LRU, S3-FIFO, frecency) on a hash-sampled miniature of the live request stream at the live
budget; the leader is the one with the most recent hits, switching only past a noise margin.
The live cache runs the leader alone, unchanged, so while one leader stays in charge it evicts
exactly as that fixed policy would, at that policy's speed. On a switch the new leader adopts
the resident blocks (``EvictionPolicy.adopt``: recency and hit counts are on every block, the
uses from before a block's last insertion are kept here), and its decisions match its fixed
self again within about one cache turnover. The adaptive policy
keeps a bounded history of evicted hashes (uses, last use) for the same reason: a new leader
gets the frecency history it would have built (under a frecency leader, which keeps that
history itself, the adaptive policy keeps nothing and costs nothing extra).

Why this: the bound to meet is the best *fixed* policy on each workload, which following the
measured winner reaches once the winner is clear and stays within the sims' noise when the
candidates are close; regret-weighted mixing (LeCaR, Cacheus) evicts by an order none of the
candidates would, and tracking every candidate on the live cache would cost each one's upkeep.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from promptcache.core.block import Block
from promptcache.core.hashing import BlockHash
from promptcache.core.policies.frecency import FrecencyPolicy, ReuseGap
from promptcache.core.policy import EvictionPolicy, make_policy, register_policy

if TYPE_CHECKING:
    from promptcache.core.whatif import WhatIf

# the first is in charge until the miniatures pick: frecency, which is LRU for blocks used once
# and held or beat LRU on every chat trace, where starting at LRU cost the cold start (Mooncake)
CANDIDATES = ("frecency", "lru", "s3fifo")
HISTORY_FACTOR = 8  # evicted hashes remembered per resident block (as frecency's own history)
HISTORY_MIN = 64


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, candidate_names: Sequence[str] = CANDIDATES) -> None:
        self.candidate_names = tuple(candidate_names)
        self.current = 0  # index of the candidate in charge
        self.whatif: WhatIf | None = None  # calls hand_over when its leader changes
        # every resident block with the uses it had before (remembered across evictions), and
        # evicted hashes, oldest first: (uses, last use); both for a hand-over. The history is a
        # plain dict (insertion order) cut back to its newest entries now and then: the hot
        # calls stay a few dict operations, the trimming costs O(1) amortized. A frecency
        # leader keeps both itself (``FrecencyPolicy.hand_over_state``): then neither is kept
        # here and its own insert and evict are called directly.
        self._resident: dict[Block, int] = {}
        self._history: dict[BlockHash, tuple[int, int]] = {}
        self._history_cap = 2 * HISTORY_MIN
        self._keeper: FrecencyPolicy | None = None  # the leader, when it keeps them
        # reuse intervals, measured by a frecency leader, else here: a new frecency leader
        # starts from them, where its first observation alone set its window for thousands of
        # requests (held-out trace, 3.1M: back at request 3,201 or 3,202, .1663 or .1797)
        self._reuse = ReuseGap()
        self.policy: EvictionPolicy = make_policy(self.candidate_names[0])
        self._follow(self.policy)

    def _follow(self, p: EvictionPolicy) -> None:
        """Route the hot calls to the leader's own bound methods: they cost nothing extra (but
        one call per access measuring reuse intervals, under a leader that is not frecency)."""
        self.policy = p
        self.on_access: Callable[[Sequence[Block], bool, int], None] = p.on_access
        self._on_access: Callable[[Sequence[Block], bool, int], None] = p.on_access
        self.add_evictable: Callable[[Block], None] = p.add_evictable
        self.remove_evictable: Callable[[Block], None] = p.remove_evictable
        self.pop_victim: Callable[[], Block | None] = p.pop_victim
        self.admit: Callable[[Block, Block], bool] = p.admit
        self.check_integrity: Callable[[set[int]], None] = p.check_integrity
        self._on_insert: Callable[[Block], None] = p.on_insert
        self._on_evict: Callable[[Block], None] = p.on_evict
        self._keeper = p if isinstance(p, FrecencyPolicy) else None
        if self._keeper is not None:
            self.on_insert: Callable[[Block], None] = p.on_insert
            self.on_evict: Callable[[Block], None] = p.on_evict
            self._resident, self._history = {}, {}
            self._keeper.share_reuse(self._reuse)
        else:
            self.on_insert, self.on_evict = self._track_insert, self._track_evict
            self.on_access = self._track_access

    def sample_at(self, rate: int) -> None:
        self._reuse.scale = rate  # every frecency leader measures into this one

    def hand_over(self, index: int) -> None:
        """Put candidate ``index`` in charge: a fresh instance adopts the resident blocks.
        Call only between tier operations (the what-if lookup hook is such a point)."""
        if self._keeper is not None:
            self._resident, self._history = self._keeper.hand_over_state()
        self.current = index
        p = make_policy(self.candidate_names[index])
        resident = self._resident
        by_age = sorted(resident, key=lambda b: b.last_access)
        p.adopt({b: resident[b] for b in by_age}, self._trim_history())
        self._follow(p)

    def _track_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        if is_hit:
            self._reuse.observe_hit(blocks, now)
        self._on_access(blocks, is_hit, now)

    def _track_insert(self, block: Block) -> None:
        seen = self._history.pop(block.block_hash, None)
        if seen is None:
            self._resident[block] = 0
        else:
            self._resident[block] = seen[0]
            self._reuse.observe_return(block, seen[1])
        self._on_insert(block)

    def _track_evict(self, block: Block) -> None:
        before = self._resident.pop(block, None)
        if before is None:
            return
        self._on_evict(block)
        history = self._history
        history[block.block_hash] = (before + 1 + block.num_hits, block.last_access)
        if len(history) > self._history_cap:
            self._trim_history()

    def _trim_history(self) -> dict[BlockHash, tuple[int, int]]:
        """Keep the newest ``HISTORY_FACTOR`` per resident block (at least ``HISTORY_MIN``);
        the history then grows to twice that before the next cut."""
        limit = max(HISTORY_FACTOR * len(self._resident), HISTORY_MIN)
        history = self._history
        if len(history) > limit:
            history = self._history = dict(islice(history.items(), len(history) - limit, None))
        self._history_cap = 2 * limit
        return history

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        if self._keeper is None:
            self._resident.update(resident)
            self._history = dict(history)
            self._trim_history()
        self.policy.adopt(resident, history)


register_policy("adaptive")(AdaptivePolicy)
