"""What-if simulations of the live workload on hash-sampled miniatures (``minisim``): every
candidate policy at the live budget, which picks the policy the live cache follows
(``AdaptivePolicy``), and the leader at 0.5x, 1x and 2x the budget, which draws the hit-rate-vs-
budget curve the stats and metrics expose and a recommendation when a bigger budget would pay.
The curve is anchored on the live cache's measured hit rate (plus the miniatures' differences
between budgets): a sample can miss a few very hot blocks (one shared system prompt), which
shifts every budget's estimate alike.

Sampling rate 1/R: R is the largest power of two (at most 2, more only while a miniature would
hold over ``MAX_SAMPLED_BLOCKS``) leaving at least ``MIN_SAMPLED_BLOCKS`` sampled blocks in a 1x
miniature, but at least ``MIN_RATE`` while that leaves ``MIN_TINY_BLOCKS``: a small cache turns
over every few requests, so simulating it at full size would cost each candidate the live
cache's whole upkeep, while a half-size miniature still ranks the candidates
(replay_bench.py, tests/test_adaptive.py). The curve's 1x miniature is the leader's candidate
miniature when both have one rate, so the what-if work costs about (K + 2)/R of the live cache's
upkeep, (K + 3)/R when the curve is sparser. Hits
are counted with an exponential decay over ``horizon`` sampled lookups, so the curve follows
the recent workload; the leader is picked by the candidates' ``Race`` (``core/race.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from promptcache.core.budget import format_size
from promptcache.core.figures import Series, Snapshot
from promptcache.core.follow import Following
from promptcache.core.hashing import BlockHash
from promptcache.core.minisim import Census, MiniCache, sampled_indices
from promptcache.core.policies import make_policy
from promptcache.core.policy import EvictionPolicy
from promptcache.core.race import RACE_FULLS, Decayed
from promptcache.core.sequence import TokenSeq

log = logging.getLogger("promptcache.whatif")

FACTORS = (0.5, 1.0, 2.0)
MIN_SAMPLED_BLOCKS = 256  # in the 1x miniatures, which pick the leader (128 misranked on chat)
MIN_CURVE_BLOCKS = 32  # in the 0.5x miniature, which only draws the curve
# below this a small cache's miniatures cost more than the live cache's upkeep; at 1/4 a
# 300-block cache's 75-block miniatures flipped between frecency and S3-FIFO (scan_wave +.0086)
MIN_RATE = 2
MIN_TINY_BLOCKS = 32  # ... unless that leaves fewer sampled blocks in a 1x miniature
# sparse miniatures misrank: at 1/16 the race handed mooncake_like_slow 3.1M to LRU a third
# into the trace (+.0104); at 1/8 a 6,000-block cache's S3-FIFO led frecency's miniature where
# frecency led at full size, and the race handed back 2,000 requests late (zipf_0.8 384K)
MAX_RATE = 2
MAX_SAMPLED_BLOCKS = 4096  # ... but a huge cache's miniatures are sparser still: cost bound
FIT_FULLS = 2.0  # the census's image is averaged over this many miniature cache-fulls
RECOMMEND_GAIN = 0.05  # log a bigger budget when 2x would add this much hit rate


def _rate(budget_blocks: float, min_blocks: int, max_rate: int) -> int:
    """The largest power of two <= max_rate leaving at least ``min_blocks`` sampled blocks,
    or a larger one while more than ``MAX_SAMPLED_BLOCKS`` would be left."""
    rate = 1
    while budget_blocks / (rate * 2) >= min_blocks and (
        rate * 2 <= max_rate or budget_blocks / rate > MAX_SAMPLED_BLOCKS
    ):
        rate *= 2
    return rate


class WhatIf:
    """Not thread-safe: the owning cache calls it under its lock."""

    def __init__(self, budget_bytes: int, block_size: int, policy_names: Sequence[str]) -> None:
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.policy_names = tuple(policy_names)
        self.leader = 0  # index into policy_names
        self.on_switch: Callable[[int], None] | None = None  # told the new leader's index
        self.num_switches = 0  # the live cache's hand-overs
        self.following: Following | None = None  # which race the live cache follows
        self.rates: tuple[int, int] = (0, 0)  # (live, curve) R; 0 until a save tells block bytes
        self.live: Decayed | None = None  # every candidate at 1x
        self.curve: Decayed | None = None  # the leader at 0.5x, 1x and 2x (1x: see _curve_at)
        self._curve_at: list[int] = []  # per factor, its sim in curve, or -1: the live leader's
        self._actual = [0.0, 0.0]  # the live cache's decayed hit tokens, lookup tokens
        self._bytes = 0  # new bytes / new tokens saved: the live bytes per token
        self._tokens = 0
        self._block_bytes = 0
        self._chain_seq: TokenSeq | None = None
        self._chains: list[list[int]] = []
        self._tail_seq: TokenSeq | None = None  # the sequence and end of _tail_hash
        self._tail_end = 0
        self._tail_hash = BlockHash(b"")
        self._lookups_since_log = 0
        self._logged_gain = 0.0
        # the live cache's sampled image (``follow``): the miniatures hold what it holds
        self.census: Census | None = None
        self._held: Callable[[], int] = lambda: 0
        self._fitted: tuple[int, int] = (0, 0)  # (live, curve) sampled blocks at 1x
        self._scale = [1.0, 1.0]  # (live, curve): the census's image over budget / block bytes

    def follow(self, census: Census, held_bytes: Callable[[], int]) -> None:
        """Size the miniatures by the live tier's ``census`` (kept up to date by the tier) and
        its held bytes, not by budget / block bytes."""
        self.census = census
        self._held = held_bytes

    # -- setup -------------------------------------------------------------------------------

    def _capacity(self, factor: float, rate: int) -> int:
        """Sampled blocks at ``factor`` x the budget: budget / block bytes / rate, scaled by
        the census (``_fit``) when there is one."""
        scale = self._scale[0 if rate == self.rates[0] else 1]
        return max(1, round(factor * scale * self.budget_bytes / (self._block_bytes * rate)))

    def _fit(self, weight: float) -> None:
        """Follow the live cache's sampled image: per rate, the bytes of its sampled resident
        blocks plus the free room, over the budget, averaged over ``FIT_FULLS`` miniature
        cache-fulls of sampled lookups (``weight``: this lookup's share of one). The image
        swings with which blocks happen to be resident (150 blocks at 1/4: 38 +- 5), which the
        policies' miniatures do not follow block for block; its lasting part (the working
        set's own sampled share, checkpoints) is what the miniatures must hold."""
        assert self.live is not None and self.curve is not None and self.census is not None
        nominal = self.budget_bytes / self._block_bytes
        free = max(0, self.budget_bytes - self._held()) / self._block_bytes
        keep = math.exp(-weight / FIT_FULLS)
        for j, rate in enumerate(self.rates):
            sampled = self.census.sampled(256 // rate) / self._block_bytes
            now = (sampled + free / rate) / (nominal / rate)
            self._scale[j] = self._scale[j] * keep + now * (1.0 - keep)
        fitted = (self._capacity(1.0, self.rates[0]), self._capacity(1.0, self.rates[1]))
        if fitted == self._fitted:
            return
        self._fitted = fitted
        for sim in self._sims_at_1x():
            sim.resize(fitted[0])
        for f, k in zip(FACTORS, self._curve_at, strict=True):
            if k >= 0:
                self.curve.sims[k].resize(self._capacity(f, self.rates[1]))

    def _sims_at_1x(self) -> list[MiniCache]:
        assert self.live is not None and self.following is not None
        return [*self.live.sims, *self.following.sims]

    def _new_curve(self) -> Decayed:
        """The leader's miniatures at each factor; at 1x its candidate miniature (simulated
        already) when the curve and the candidates share a sampling rate."""
        rate = self.rates[1]
        shared = rate == self.rates[0]
        self._curve_at = []
        sims: list[MiniCache] = []
        for f in FACTORS:
            if f == 1.0 and shared:
                self._curve_at.append(-1)
                continue
            self._curve_at.append(len(sims))
            capacity = self._capacity(f, rate)
            sims.append(
                MiniCache(
                    make_policy(self.policy_names[self.leader]), capacity, self.block_size, rate
                )
            )
        return Decayed(sims, max(32.0 * self._capacity(1.0, rate), 4096.0))

    def _curve_rate(self, j: int) -> float:
        """The curve's recent sampled hit rate at ``FACTORS[j]``."""
        assert self.curve is not None and self.live is not None
        k = self._curve_at[j]
        return self.live.rate(self.leader) if k < 0 else self.curve.rate(k)

    def note_saved(self, num_bytes: int, num_tokens: int) -> None:
        """New blocks were saved: learn the bytes a block of tokens takes (resizing the sims)."""
        if num_tokens <= 0:
            return
        self._bytes += num_bytes
        self._tokens += num_tokens
        block_bytes = max(1, round(self._bytes * self.block_size / self._tokens))
        if self.live is not None and abs(block_bytes - self._block_bytes) <= 0.02 * block_bytes:
            return
        self._block_bytes = block_bytes
        if self.live is not None and self.curve is not None:
            for sim in self._sims_at_1x():
                sim.resize(self._capacity(1.0, self.rates[0]))
            for f, k in zip(FACTORS, self._curve_at, strict=True):
                if k >= 0:
                    self.curve.sims[k].resize(self._capacity(f, self.rates[1]))
            return
        budget_blocks = self.budget_bytes / block_bytes
        live = max(
            _rate(budget_blocks, MIN_SAMPLED_BLOCKS, MAX_RATE),
            _rate(budget_blocks, MIN_TINY_BLOCKS, MIN_RATE),
        )
        self.rates = (live, max(live, _rate(budget_blocks / 2, MIN_CURVE_BLOCKS, MAX_RATE)))
        cap = self._capacity(1.0, live)
        sims = [MiniCache(make_policy(p), cap, self.block_size, live) for p in self.policy_names]
        self.live = Decayed(sims, max(32.0 * cap, 4096.0), max(RACE_FULLS * cap, 1024.0), live)
        self.curve = self._new_curve()
        assert self.live.race is not None
        self.following = Following(self.live.race, self.policy_names, cap, live)

    # -- the live request stream --------------------------------------------------------------

    def _sampled(self, seq: TokenSeq, end: int) -> list[tuple[list[BlockHash], float]]:
        """(live, curve): the sampled blocks among ``seq``'s first ``end`` tokens, and the
        fraction of a block the last one holds when it is the partial block ending at ``end``
        (else 0). A partial block takes the live budget like any other (one per distinct
        prompt: in a trace of one-off questions on shared documents, most of what is evicted);
        its hash, like a full block's, covers the prefix, so it samples the same way."""
        hashes = seq.full_hashes()
        if seq is not self._chain_seq:  # a lookup and its saves share one sampling pass
            self._chain_seq = seq
            self._chains = sampled_indices(hashes, [256 // r for r in self.rates])
        num_blocks, rest = divmod(end, self.block_size)
        tail_hash = None
        if rest:  # a lookup and the save after it share the tail's hash too
            if self._tail_seq is not seq or self._tail_end != end:
                self._tail_seq, self._tail_end = seq, end
                self._tail_hash = seq.partial_hash(end)
            tail_hash = self._tail_hash
        out = []
        for chain, r in zip(self._chains, self.rates, strict=True):
            sampled = [hashes[i] for i in chain if i < num_blocks]
            if tail_hash is not None and tail_hash[-1] < 256 // r:
                sampled.append(tail_hash)
                out.append((sampled, rest / self.block_size))
            else:
                out.append((sampled, 0.0))
        return out

    def on_lookup(self, seq: TokenSeq, num_hit_tokens: int) -> None:
        """A live lookup of ``seq`` found ``num_hit_tokens`` cached."""
        if self.live is None or self.curve is None:
            return
        keep = math.exp(-seq.num_tokens / (self.curve.horizon * self.rates[1] * self.block_size))
        self._actual[0] = self._actual[0] * keep + num_hit_tokens
        self._actual[1] = self._actual[1] * keep + seq.num_tokens
        (live_chain, live_tail), (curve_chain, curve_tail) = self._sampled(seq, seq.num_tokens)
        if self.census is not None and live_chain:
            self._fit(len(live_chain) * self.live.sims[0].unit / self.live.sims[0].budget)
        if curve_chain:
            self.curve.lookup(curve_chain, curve_tail)
        if not live_chain:
            return
        live = self.live
        got = live.lookup(live_chain, live_tail)
        following = self.following
        assert live.race is not None and following is not None
        if live.race.volume:
            sim = live.sims[0]
            following.lookup(live_chain, live_tail, got, sim.budget // sim.unit, sim.unit)
            if following.pick != self.leader:
                self.leader = following.pick
                self.num_switches += 1
                self.curve = self._new_curve()
                if self.on_switch is not None:
                    self.on_switch(self.leader)
        self._lookups_since_log += 1
        if self._lookups_since_log >= 256:
            self._lookups_since_log = 0
            self._maybe_recommend()

    def on_save(self, seq: TokenSeq, num_tokens: int) -> None:
        if self.live is None or self.curve is None:
            return
        (live_chain, live_tail), (curve_chain, curve_tail) = self._sampled(seq, num_tokens)
        self.live.save(seq.root, live_chain, live_tail)
        assert self.following is not None
        self.following.save(seq.root, live_chain, live_tail)
        self.curve.save(seq.root, curve_chain, curve_tail)

    # -- results -----------------------------------------------------------------------------

    def hit_rate_by_budget(self) -> dict[str, float]:
        """Recent hit rate at 0.5x, 1x and 2x the budget: the live one measured at 1x, and the
        leader's miniatures' differences from 1x added for the others."""
        if self.curve is None or self._actual[1] <= 0:
            return {}
        now = self._actual[0] / self._actual[1]
        rates = [self._curve_rate(j) for j in range(len(FACTORS))]
        at_1x = rates[FACTORS.index(1.0)]
        return {
            f"{f:g}x": min(1.0, max(0.0, now + r - at_1x))
            for f, r in zip(FACTORS, rates, strict=True)
        }

    def snapshot(self) -> Snapshot:
        live = self.live
        leader = self.policy_names[self.leader]
        by_budget = {k: round(v, 4) for k, v in self.hit_rate_by_budget().items()}
        by_policy = (
            {p: round(live.rate(j), 4) for j, p in enumerate(self.policy_names)} if live else {}
        )
        rate = 1 / self.rates[0] if self.rates[0] else 0.0
        volume = round(live.volume, 1) if live else 0.0
        race = "slow" if self.following is not None and self.following.is_slow else "fast"
        values = {
            "policy_leader": leader,
            "policy_race": race,
            "num_policy_switches": self.num_switches,
            "whatif_sample_rate": rate,
            "whatif_sampled_lookup_blocks": volume,
            "whatif_hit_rate_by_budget": by_budget,
            "whatif_sampled_hit_rate_by_policy": by_policy,
        }
        series = (
            Series("policy_leader", "gauge", {leader: 1}, "policy"),  # the name as a label
            Series("policy_race", "gauge", {race: 1}, "race"),
            Series("num_policy_switches", "counter", self.num_switches),
            Series("whatif_sample_rate", "gauge", rate),
            Series("whatif_sampled_lookup_blocks", "gauge", volume),
            Series("whatif_hit_rate_by_budget", "gauge", by_budget, "budget"),
            Series("whatif_sampled_hit_rate_by_policy", "gauge", by_policy, "policy"),
        )
        return Snapshot(values, series)

    def recommendation(self) -> str | None:
        """A sentence when 2x the budget would clearly pay, after enough traffic to tell."""
        curve = self.curve
        if curve is None or curve.volume < 0.5 * curve.horizon:
            return None
        rates = self.hit_rate_by_budget()
        if not rates or rates["2x"] - rates["1x"] < RECOMMEND_GAIN:
            return None
        return (
            f"a RAM budget of {format_size(2 * self.budget_bytes)} (2x) would raise the prompt"
            f" cache hit rate from {rates['1x']:.2f} to about {rates['2x']:.2f}"
            f" (0.5x: {rates['0.5x']:.2f})"
        )

    def _maybe_recommend(self) -> None:
        text = self.recommendation()
        if text is None:
            return
        rates = self.hit_rate_by_budget()
        gain = rates["2x"] - rates["1x"]
        if gain >= self._logged_gain + RECOMMEND_GAIN / 2:
            log.warning("prompt cache: %s", text)
            self._logged_gain = gain


def attach_whatif(policy: EvictionPolicy, budget_bytes: int, block_size: int) -> WhatIf | None:
    """What-if simulations for a policy that follows them (``AdaptivePolicy``), else None."""
    from promptcache.core.policies.adaptive import AdaptivePolicy

    if not isinstance(policy, AdaptivePolicy):
        return None
    whatif = WhatIf(budget_bytes, block_size, policy.candidate_names)
    policy.whatif = whatif
    whatif.on_switch = policy.hand_over
    return whatif
