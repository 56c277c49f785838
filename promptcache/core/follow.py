"""Two ways of following the race, judged by what following costs.

The live cache follows the race's leader (``race.py``, over ``RACE_FULLS`` miniature
cache-fulls), and each hand-over costs the hits of a cache the new leader did not fill. Where
the lead swings back and forth faster than a hand-over pays (coding agents: one lookup, an
agent's whole history, hits or misses together), following loses to standing still on the
policy that wins over the long run (coding_agent 512K: .0050 behind LRU alone, 15-17
hand-overs). So once the race has changed its mind (``START_AFTER_SWITCHES``), two miniatures
follow two races through their hand-overs, paying them as the live cache would: the fast race,
and a slow one over ``SLOW_FULLS``. The live cache follows the slow race while its miniature has
clearly hit more (``SLOW_GAP`` of the volume, ``SLOW_Z`` times its noise), and the fast race
again once that one's has. Both miniatures start empty and are judged once full: the race's
miniatures need no such pair, and most traffic (chat: the race picks once or twice) never
starts it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from promptcache.core.hashing import BlockHash
from promptcache.core.minisim import MiniCache
from promptcache.core.policies.adaptive import AdaptivePolicy
from promptcache.core.race import Race

SLOW_FULLS = 32.0
SLOW_GAP = 0.005  # at .002, the fast follower's dip right after its hand-over lost zipf .004
SLOW_Z = 2.0
START_AFTER_SWITCHES = 2


class Follower:
    """A race's pick among the candidates and, once started, a miniature that follows it."""

    __slots__ = ("race", "pick", "num_switches", "since_switch", "policy", "sim")

    def __init__(self, race: Race) -> None:
        self.race = race
        self.pick = 0
        self.num_switches = 0
        self.since_switch = math.inf  # sampled lookup blocks; the first switch needs no settling
        self.policy: AdaptivePolicy | None = None
        self.sim: MiniCache | None = None

    def start(self, names: Sequence[str], capacity: int, block_bytes: int, rate: int) -> None:
        """An empty miniature sampling 1 block in ``rate``, its policy the race's pick."""
        self.policy = AdaptivePolicy(names)
        if self.pick:
            self.policy.hand_over(self.pick)
        self.sim = MiniCache(self.policy, capacity, block_bytes, rate)

    def step(self, num_blocks: float, settle: float) -> None:
        """After a lookup of ``num_blocks`` sampled blocks the race has counted: take the race's
        new pick, ``settle`` sampled blocks after the last one at the soonest."""
        self.since_switch += num_blocks
        best = self.race.challenger(self.pick, self.num_switches)
        if best is not None and self.since_switch >= settle:
            self.pick = best
            self.num_switches += 1
            self.since_switch = 0.0
            if self.policy is not None:
                self.policy.hand_over(best)


class Following:
    """Which race the live cache follows. Not thread-safe: ``WhatIf`` calls it under the
    owning cache's lock."""

    __slots__ = ("names", "rate", "fast", "slow", "judge", "is_slow")

    def __init__(self, race: Race, names: Sequence[str], capacity: int, rate: int) -> None:
        """``race``: the candidates' (fast) race; ``rate``: the miniatures sample 1 in it."""
        self.names = tuple(names)
        self.rate = rate
        horizon = max(SLOW_FULLS * capacity, 4096.0)
        self.fast = Follower(race)
        self.slow = Follower(Race(len(self.names), horizon, rate))
        self.judge = Race(2, horizon, rate)  # fast, slow
        self.is_slow = False

    @property
    def pick(self) -> int:
        """The candidate the live cache should follow now."""
        return (self.slow if self.is_slow else self.fast).pick

    @property
    def sims(self) -> list[MiniCache]:
        return [f.sim for f in (self.fast, self.slow) if f.sim is not None]

    def lookup(
        self, chain: list[BlockHash], tail: float, got: list[float], capacity: int, unit: int
    ) -> None:
        """A sampled lookup the race has counted; ``got``: the candidates' hits in it;
        ``capacity``: sampled blocks in a miniature, of ``unit`` bytes each."""
        fast, slow = self.fast, self.slow
        size = len(chain) - (1.0 - tail if tail else 0.0)
        slow.race.add(got, size)
        if fast.sim is None and fast.num_switches >= START_AFTER_SWITCHES:
            fast.start(self.names, capacity, unit, self.rate)
            slow.start(self.names, capacity, unit, self.rate)
        if fast.sim is not None and slow.sim is not None:
            followed = [fast.sim.lookup(chain, tail), slow.sim.lookup(chain, tail)]
            judge = self.judge
            if judge.volume or fast.sim.used + unit > fast.sim.budget:
                judge.add(followed, size)
                self._judge()
        fast.step(len(chain), 2 * capacity)  # two miniature cache-fulls between hand-overs
        slow.step(len(chain), 2 * capacity)

    def _judge(self) -> None:
        judge = self.judge
        ahead, behind = (0, 1) if self.is_slow else (1, 0)
        lead = (judge.hits[ahead] - judge.hits[behind]) / judge.volume
        if lead > SLOW_GAP and judge.significance(ahead, behind) > SLOW_Z:
            self.is_slow = not self.is_slow

    def save(self, root: BlockHash, chain: list[BlockHash], tail: float) -> None:
        for sim in self.sims:
            sim.save(root, chain, tail)
