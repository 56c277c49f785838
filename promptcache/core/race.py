"""The race among the what-if candidates that picks the policy the live cache follows.

Each candidate's miniature (``minisim``) sees the same sampled lookups; the race keeps their
hits decayed over ``RACE_FULLS`` miniature cache-fulls of sampled lookup blocks, counted from
when the first miniature filled: until one evicts, every candidate holds the same blocks and a
lookup says nothing about which evicts better (counting them made a clear winner wait half a
short trace, replay_bench zipf). The horizon is a few cache-fulls, not the curve's 32: a policy
that wins the cold start and loses the steady state (S3-FIFO then frecency on Mooncake) would
otherwise hold on for most of the trace on the strength of its first minutes.

A challenger takes over when its lead is ``SWITCH_MARGIN`` of the race's volume (near-ties
are not worth a hand-over), or a smaller lead (at least ``SWITCH_MIN_LEAD``) is ``SWITCH_Z``
times its noise: the root of the summed squares of the per-lookup differences, a paired sign
test (where samples are few the miniatures' gap is a fraction of the full-size one, zipf: 0.004
against 0.02, but its sign holds). Either way the lead must be ``SWITCH_MIN_BLOCKS`` sampled
blocks: right after the miniatures fill, two or three blocks of luck are half a percent of the
race's volume (they handed Mooncake and scan_bursts to a worse policy for half the trace). A
dense miniature's blocks stand for fewer live ones: there the lead must also be
``SWITCH_MIN_LIVE_BLOCKS`` of the live cache's (at 1/2, 16 sampled: with 8, a 150-block cache
changed hands 19 times on scan_hot, against 9 at 1/4).

Each hand-over the race has made raises the significance the margin path needs by
``MARGIN_Z_PER_SWITCH``: a lead that one big lookup can win alone (an agent's whole history,
hit or missed together) passes the margin as easily as it is lost again, and each hand-over
costs the hits of a cache the new leader did not fill (coding_agent 256K, mean of 3 cache
namespaces: 157-168 hand-overs, .0045 behind LRU alone; with the rise, 24-25 and .0013 ahead).
A race that picked once or twice, as chat traffic does, keeps its quick margin path.
"""

from __future__ import annotations

import math

from promptcache.core.hashing import BlockHash
from promptcache.core.minisim import MiniCache

RACE_FULLS = 8.0
SWITCH_MARGIN = 0.005
SWITCH_MIN_LEAD = 0.002
SWITCH_Z = 3.0
SWITCH_MIN_BLOCKS = 8.0
SWITCH_MIN_LIVE_BLOCKS = 32.0
MARGIN_Z_PER_SWITCH = 1.0 / 16


class Race:
    """Decayed hits per candidate and decayed squares of each pair's per-lookup difference."""

    __slots__ = ("hits", "squares", "volume", "horizon", "min_lead")

    def __init__(self, num: int, horizon: float, rate: int = 1) -> None:
        """``rate``: the miniatures sample 1 block in ``rate``."""
        self.hits = [0.0] * num
        self.squares = [[0.0] * num for _ in range(num)]
        self.volume = 0.0  # decayed sampled lookup blocks since the first miniature filled
        self.horizon = horizon
        self.min_lead = max(SWITCH_MIN_BLOCKS, SWITCH_MIN_LIVE_BLOCKS / rate)  # sampled blocks

    def add(self, got: list[float], num_blocks: float) -> None:
        """One lookup of ``num_blocks`` sampled blocks; ``got[j]``: candidate j's hits."""
        keep = math.exp(-num_blocks / self.horizon)
        self.volume = self.volume * keep + num_blocks
        hits = self.hits
        for j, row in enumerate(self.squares):
            hits[j] = hits[j] * keep + got[j]
            for k in range(j + 1, len(got)):
                d = got[j] - got[k]
                row[k] = row[k] * keep + d * d

    def significance(self, j: int, k: int) -> float:
        """``j``'s lead over ``k`` in units of its noise (0 while they never differed)."""
        sq = self.squares[min(j, k)][max(j, k)]
        return (self.hits[j] - self.hits[k]) / math.sqrt(sq) if sq > 0 else 0.0

    def challenger(self, leader: int, num_switches: int = 0) -> int | None:
        """The candidate to hand over to, or None while ``leader`` should stay; the race has
        handed over ``num_switches`` times before."""
        if not self.volume:
            return None
        best = max(range(len(self.hits)), key=self.hits.__getitem__)
        blocks = self.hits[best] - self.hits[leader]
        lead = blocks / self.volume
        if best == leader or lead <= SWITCH_MIN_LEAD or blocks < self.min_lead:
            return None
        z = self.significance(best, leader)
        if z > SWITCH_Z or (lead > SWITCH_MARGIN and z >= num_switches * MARGIN_Z_PER_SWITCH):
            return best
        return None


class Decayed:
    """Decayed hits of some miniatures over a decayed count of sampled lookup blocks, and, with
    ``race_horizon``, their ``Race``."""

    __slots__ = ("sims", "hits", "volume", "horizon", "race")

    def __init__(
        self, sims: list[MiniCache], horizon: float, race_horizon: float = 0.0, rate: int = 1
    ) -> None:
        self.sims = sims
        self.hits = [0.0] * len(sims)
        self.volume = 0.0
        self.horizon = horizon
        self.race = Race(len(sims), race_horizon, rate) if race_horizon else None

    def lookup(self, chain: list[BlockHash], tail: float = 0.0) -> list[float]:
        """Each miniature's hits; ``tail``: the last hash is a partial block of that fraction
        of a block."""
        size = len(chain) - (1.0 - tail if tail else 0.0)
        keep = math.exp(-size / self.horizon)
        self.volume = self.volume * keep + size
        hits = self.hits
        got = [sim.lookup(chain, tail) for sim in self.sims]
        for j, h in enumerate(got):
            hits[j] = hits[j] * keep + h
        race = self.race
        if race is not None and (race.volume or any(s.used + s.unit > s.budget for s in self.sims)):
            race.add(got, size)
        return got

    def save(self, root: BlockHash, chain: list[BlockHash], tail: float = 0.0) -> None:
        for sim in self.sims:
            sim.save(root, chain, tail)

    def rate(self, j: int) -> float:
        return self.hits[j] / self.volume if self.volume > 0 else 0.0
