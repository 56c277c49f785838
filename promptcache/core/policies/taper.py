"""Frecency whose cold chains taper: a parent exposed by its leaf's eviction gets one more lap.

Under frecency (as under LRU) every block of a chain used once was last used at the same time,
so once the deepest leaves, its parent is next in line and the whole chain leaves at once. On a
tree, S3-FIFO instead appends the exposed parent at its queue's tail: a cold chain loses one
block per lap and a document that comes back much later still finds its first blocks. That wins
a chat trace's cold start, before frecency has measured reuse (held-out Mooncake trace, 3.1M
tokens, requests 800-1,600: S3-FIFO .199, frecency .183). Here an exposed parent's priority is
raised to the policy clock's now (never lowered), frecency's rule otherwise: its cold start
with frecency's steady state. Elsewhere it keeps deep tails that one-off traffic never reuses
(mooncake_like at 1M: .252 vs frecency's .284): a fixed policy, not one of the race's candidates
(as a fourth it cost the Zipf shapes more than it won on the held-out trace; docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from promptcache.core.block import Block
from promptcache.core.policies.frecency import FrecencyPolicy
from promptcache.core.policy import register_policy


class TaperPolicy(FrecencyPolicy):
    name = "taper"

    def __init__(self) -> None:
        super().__init__()
        self._now = 0  # the tier clock at the latest insert or use
        self._exposed: Block | None = None  # the parent of the block evicted last

    def on_insert(self, block: Block) -> None:
        self._now = max(self._now, block.last_access)
        super().on_insert(block)

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        self._now = max(self._now, now)
        super().on_access(blocks, is_hit, now)

    def on_evict(self, block: Block) -> None:
        self._exposed = block.parent
        super().on_evict(block)

    def add_evictable(self, block: Block) -> None:
        exposed, self._exposed = self._exposed, None
        if block is not exposed:
            super().add_evictable(block)
            return
        meta = self._metas[block]
        self._num_listed += 1
        freq = meta.base_freq + block.num_hits
        self._push(block, meta, max(self._priority(block, block.last_access, freq), self._now))


register_policy("taper")(TaperPolicy)
