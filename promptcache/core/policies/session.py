"""Session-aware eviction: what a prompt cache knows about a block and a generic cache does not.

A generic cache sees a key's uses. A prompt cache sees chains: every block extends its parent,
and a conversation or agent session is a chain that grows by one turn per request. This policy
groups blocks into *sessions* (a chain extended at its tip, turn after turn) and ranks each
evictable leaf by ``last + S + F``, lowest first (so only leaves go, as the tier requires; a
block whose parent is gone is unreachable and never kept):

- ``S = A * gap * ln(1 + turns) * cost``, the session credit. ``turns``: how often the session
  came back; ``gap``: its own typical idle time between turns (geometric mean, tier clock). An
  agent that returns every few seconds is dropped after a few of its own gaps of silence; a chat
  whose user reads for minutes is kept for minutes. A session never continued gets no credit
  (LRU). ``cost``: ``1 + DEPTH_WEIGHT * depth / mean depth``, recompute cost per byte (deeper
  blocks attend over more context); at the default weight 0 the rule ranks by hit rate alone.
- ``F = W * ln(1 + shared uses)``: frequency, but only uses the block's own session does not
  explain (hits by other chains: a shared system prompt, a document several chats paste), and
  the uses remembered from before its hash was last evicted (frecency's history; remembering
  only the shared ones cost 0.02 of hit rate on the Mooncake trace). A long session's old
  history is hit every turn while it runs; those hits buy it nothing. ``W`` is frecency's
  window (reuse intervals observed).

Session membership: a new block joins its parent's session when the parent is where that session
left off (its tip, or the tip's parent); otherwise (a new chat under a shared prefix, a branch
further back) it opens a new session. When a session's tip is evicted the tip moves to the
parent if that is the session's own, unshared block, else the session has ended. Costs O(1)
dict work plus a heap push per listed block, as frecency.

Measured (docs/benchmarks.md): it ranks with frecency nearly everywhere, gains at most
0.004 over the best other fixed policy (Mooncake, first half, 10 M; below frecency on the
held-out half), and loses like frecency where recency-first loses (loops, finished coding-agent
histories); the variants tried (the credit's sign and size, own or global gaps, no sharing
credit) did not beat LRU on chat traffic, so it is not a candidate of the default. The keyword arguments are those variants.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from promptcache.core.block import Block
from promptcache.core.hashing import BlockHash
from promptcache.core.policies import frecency
from promptcache.core.policies.frecency import FrecencyPolicy
from promptcache.core.policy import register_policy

SESSION_WINDOWS = 1.0  # A: a session's credit in its own gaps, per ln(1 + turns)
GAP_CAP = 8.0  # a session's gap counts at most this many global reuse intervals
GAP_WEIGHT = 0.5  # EMA weight of a session's newest gap (in log space)
DEPTH_WEIGHT = 0.0  # cost per byte: 1 + this * depth / mean depth


class Session:
    __slots__ = ("turns", "log_gap", "last_touch", "tip")

    def __init__(self, tip: Block | None = None) -> None:
        self.turns = 0  # times the session came back to its tip and went on
        self.log_gap: float | None = None  # EMA of ln(idle clock between its turns)
        self.last_touch = -1  # tier clock of the session's latest use
        self.tip = tip  # its deepest resident block: where the next turn goes on from


class _Meta(frecency._Meta):
    __slots__ = ("session", "turns_at_insert", "depth")

    def __init__(self, base_freq: int, session: Session, depth: int) -> None:
        super().__init__(base_freq)
        self.session = session
        self.turns_at_insert = session.turns  # own-session hits are the turns since
        self.depth = depth  # bytes of the chain above this block


def _continues(s: Session, block: Block) -> bool:
    """Whether the chain goes on from ``block`` where session ``s`` left off: at its tip, or at
    the tip's parent (the tip was a partial last block, or the last block was re-rendered)."""
    tip = s.tip
    return tip is not None and (block is tip or block is tip.parent)


class SessionPolicy(FrecencyPolicy):
    name = "session"

    def __init__(
        self,
        session_windows: float = SESSION_WINDOWS,
        gap_cap: float = GAP_CAP,
        depth_weight: float = DEPTH_WEIGHT,
        own_history: float = 0.0,
        shared_weight: float = 1.0,
        own_gap: float = 1.0,
    ) -> None:
        super().__init__()
        self.own_gap = bool(own_gap)
        self.shared_weight = shared_weight
        self.own_history = bool(own_history)
        self.session_windows = session_windows
        self.gap_cap = gap_cap
        self.depth_weight = depth_weight
        self._mean_depth = 0.0  # EMA of inserted blocks' depth (scale-free cost)
        self._metas: dict[Block, _Meta] = {}  # type: ignore[assignment]

    def _shared_uses(self, block: Block, meta: _Meta, freq: int) -> int:
        """Uses of ``block`` beyond its insertion and its own session's later turns."""
        return freq - 1 - (meta.session.turns - meta.turns_at_insert)

    def _priority(self, block: Block, last: int, freq: int) -> float:
        meta = self._metas[block]
        s = meta.session
        pri = float(last)
        shared = self._shared_uses(block, meta, freq)
        if shared > 0:
            pri += self.shared_weight * self._window * math.log1p(shared)
        if s.turns:
            lg = self._reuse.log_gap
            glob = math.exp(lg) if lg is not None else 0.0
            gap = math.exp(s.log_gap) if s.log_gap is not None and self.own_gap else glob
            if glob and gap > self.gap_cap * glob:
                gap = self.gap_cap * glob
            credit = self.session_windows * gap * math.log1p(s.turns)
            if self.depth_weight and self._mean_depth > 0:
                credit *= 1 + self.depth_weight * meta.depth / self._mean_depth
            pri += credit
        return pri

    def on_insert(self, block: Block) -> None:
        base = self._seed_uses(block)
        parent = block.parent
        pm = self._metas.get(parent) if parent is not None else None
        depth = 0
        if pm is not None and parent is not None:
            depth = pm.depth + parent.nbytes
            s = pm.session
            if _continues(s, parent):  # the session's chain grows
                s.tip = block
            else:  # a branch: a new chat under a shared prefix, an edit further back
                s = Session(block)
        else:
            s = Session(block)
        self._mean_depth += 0.001 * (depth - self._mean_depth)
        self._metas[block] = _Meta(base, s, depth)

    def on_access(self, blocks: Sequence[Block], is_hit: bool, now: int) -> None:
        end = blocks[-1]
        meta = self._metas.get(end)
        if meta is not None:
            s = meta.session
            if is_hit and _continues(s, end):  # the session came back
                # every turn counts (a missed one would read as sharing); the clock moves by
                # at least one tick per use, so the gap is >= 1
                x = math.log(max(now - s.last_touch, 1))
                lg = s.log_gap
                s.log_gap = x if lg is None else lg + GAP_WEIGHT * (x - lg)
                s.turns += 1
                s.tip = end
            s.last_touch = now
        super().on_access(blocks, is_hit, now)

    def on_evict(self, block: Block) -> None:
        meta = self._metas.get(block)
        if meta is not None and self.own_history:
            # remember only the uses other chains made: a session's own turns end with it
            shared = self._shared_uses(block, meta, meta.base_freq + block.num_hits)
            meta.base_freq = max(shared, 0) - block.num_hits  # frecency stores base + hits
        if meta is not None:
            s = meta.session
            if s.tip is block:  # the session now ends at the parent, if that is its own
                parent = block.parent
                pm = self._metas.get(parent) if parent is not None else None
                own = (
                    pm is not None
                    and parent is not None
                    and pm.session is s
                    and self._shared_uses(parent, pm, pm.base_freq + parent.num_hits) <= 0
                )
                s.tip = parent if own else None
        super().on_evict(block)

    def adopt(
        self, resident: Mapping[Block, int], history: Mapping[BlockHash, tuple[int, int]]
    ) -> None:
        # what the blocks do not record (sessions, depth) starts afresh: one session per block
        self._history = OrderedDict(history)
        for b, uses in resident.items():
            self._metas[b] = _Meta(1 + uses, Session(b), 0)
            if b.is_evictable:
                self.add_evictable(b)

    def check_integrity(self, evictable: set[int]) -> None:
        super().check_integrity(evictable)
        for b, meta in self._metas.items():
            s = meta.session
            assert 0 <= meta.turns_at_insert <= s.turns, "a block joined a session's future"
            assert (s.turns == 0) == (s.log_gap is None), "turns counted without a gap"
            tip = s.tip
            assert tip is None or self._metas[tip].session is s, "a session's tip left it"
            parent = b.parent
            assert parent is not None
            pm = self._metas.get(parent)
            assert parent.parent is None or pm is not None, "resident parent without meta"
            assert pm is None or meta.depth == 0 or meta.depth >= pm.depth


register_policy("session")(SessionPolicy)
