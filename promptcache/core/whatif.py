"""What-if simulations of the live workload: every candidate policy at 0.5x, 1x and 2x the RAM
budget, on a hash-sampled miniature (``minisim``). They pick the policy the live cache follows
(``AdaptivePolicy``) and give the hit-rate-vs-budget curve the stats and metrics expose.

Sampling rate 1/R: R is the largest power of two (at most 64) that leaves at least
``MIN_SAMPLED_BLOCKS`` sampled blocks in the 1x miniature, so small caches are simulated at full
size (exact) and large ones cost about K*3/R of a replay. Hits are counted with an exponential
decay over ``horizon`` sampled lookups, so the leader and the curve follow the recent workload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from promptcache.core.minisim import MiniCache, sampled_indices
from promptcache.core.policy import EvictionPolicy, make_policy
from promptcache.core.sequence import TokenSeq

log = logging.getLogger("promptcache.whatif")

FACTORS = (0.5, 1.0, 2.0)
MIN_SAMPLED_BLOCKS = 512
MAX_RATE = 64
# a challenger leads once it has this much more decayed hit rate (noise guard)
SWITCH_MARGIN = 0.002
RECOMMEND_GAIN = 0.05  # log a bigger budget when 2x would add this much hit rate


class WhatIf:
    """Not thread-safe: the owning cache calls it under its lock."""

    def __init__(
        self, budget_bytes: int, block_size: int, policy_names: Sequence[str], initial: int = 0
    ) -> None:
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.policy_names = tuple(policy_names)
        self.leader = initial  # index into policy_names
        self.num_switches = 0
        self.rate = 0  # R; 0 until the first save tells the bytes per token
        self.threshold = 256
        self.sims: list[list[MiniCache]] = []  # [factor][policy]
        self.scores = [[0.0] * len(self.policy_names) for _ in FACTORS]
        self.volume = 0.0  # decayed sampled lookup blocks
        self.horizon = 1.0
        self._bytes = 0  # new bytes / new tokens saved: the live bytes per token
        self._tokens = 0
        self._block_bytes = 0
        self._chain_seq: TokenSeq | None = None
        self._chain: list[int] = []
        self._lookups_since_log = 0
        self._logged_gain = 0.0

    # -- setup -------------------------------------------------------------------------------

    def _capacity_blocks(self, factor: float) -> int:
        return max(1, round(self.budget_bytes * factor / (self._block_bytes * self.rate)))

    def note_saved(self, num_bytes: int, num_tokens: int) -> None:
        """New blocks were saved: learn the bytes a block of tokens takes (resizing the sims)."""
        if num_tokens <= 0:
            return
        self._bytes += num_bytes
        self._tokens += num_tokens
        block_bytes = max(1, round(self._bytes * self.block_size / self._tokens))
        if self.rate and abs(block_bytes - self._block_bytes) <= 0.02 * self._block_bytes:
            return
        self._block_bytes = block_bytes
        if not self.rate:
            budget_blocks = self.budget_bytes / block_bytes
            rate = 1
            while rate * 2 <= MAX_RATE and budget_blocks / (rate * 2) >= MIN_SAMPLED_BLOCKS:
                rate *= 2
            self.rate, self.threshold = rate, 256 // rate
            self.sims = [
                [
                    MiniCache(make_policy(p), self._capacity_blocks(f), self.block_size)
                    for p in self.policy_names
                ]
                for f in FACTORS
            ]
            self.horizon = max(32.0 * self._capacity_blocks(1.0), 8192.0)
        else:
            for f, row in zip(FACTORS, self.sims, strict=True):
                for sim in row:
                    sim.resize(self._capacity_blocks(f))

    # -- the live request stream --------------------------------------------------------------

    def _sampled(self, seq: TokenSeq, num_blocks: int) -> list[int]:
        if seq is not self._chain_seq:  # a lookup and its saves share one sampling pass
            self._chain_seq = seq
            self._chain = sampled_indices(seq.full_hashes(), self.threshold)
        return self._chain if not self._chain or self._chain[-1] < num_blocks else [
            i for i in self._chain if i < num_blocks
        ]

    def on_lookup(self, seq: TokenSeq) -> None:
        if not self.rate:
            return
        hashes = seq.full_hashes()
        chain = [hashes[i] for i in self._sampled(seq, len(hashes))]
        if not chain:
            return
        keep = math.exp(-len(chain) / self.horizon)
        self.volume = self.volume * keep + len(chain)
        for scores, row in zip(self.scores, self.sims, strict=True):
            for k, sim in enumerate(row):
                scores[k] = scores[k] * keep + sim.lookup(chain)
        ones = self.scores[FACTORS.index(1.0)]
        best = max(range(len(ones)), key=ones.__getitem__)
        if best != self.leader and ones[best] > ones[self.leader] + SWITCH_MARGIN * self.volume:
            self.leader = best
            self.num_switches += 1
        self._lookups_since_log += 1
        if self._lookups_since_log >= 2000:
            self._lookups_since_log = 0
            self._maybe_recommend()

    def on_save(self, seq: TokenSeq, num_tokens: int) -> None:
        if not self.rate:
            return
        num_full = num_tokens // self.block_size
        hashes = seq.full_hashes()
        chain = [hashes[i] for i in self._sampled(seq, num_full)]
        for row in self.sims:
            for sim in row:
                sim.save(seq.root, chain)

    # -- results -----------------------------------------------------------------------------

    def hit_rate(self, factor: float, policy: int | None = None) -> float:
        """Estimated recent hit rate (of sampled full blocks) at ``factor`` x the budget: of one
        candidate, or of the best one (what the adaptive cache tends to)."""
        if self.volume <= 0:
            return 0.0
        scores = self.scores[FACTORS.index(factor)]
        return (max(scores) if policy is None else scores[policy]) / self.volume

    def snapshot(self) -> dict[str, object]:
        return {
            "policy_leader": self.policy_names[self.leader],
            "whatif_sample_rate": 1 / self.rate if self.rate else 0.0,
            "whatif_sampled_lookup_blocks": round(self.volume, 1),
            "whatif_hit_rate_by_budget": {f"{f:g}x": round(self.hit_rate(f), 4) for f in FACTORS},
            "whatif_hit_rate_by_policy": {
                p: round(self.hit_rate(1.0, k), 4) for k, p in enumerate(self.policy_names)
            },
            "num_policy_switches": self.num_switches,
        }

    def recommendation(self) -> str | None:
        """A sentence when 2x the budget would clearly pay, after enough traffic to tell."""
        if self.volume < 0.5 * self.horizon:
            return None
        now, double = self.hit_rate(1.0), self.hit_rate(2.0)
        if double - now < RECOMMEND_GAIN:
            return None
        return (
            f"a RAM budget of {2 * self.budget_bytes / 2**30:.1f} GiB (2x) would raise the prompt"
            f" cache hit rate from {now:.2f} to about {double:.2f}; 0.5x would give"
            f" {self.hit_rate(0.5):.2f}"
        )

    def _maybe_recommend(self) -> None:
        text = self.recommendation()
        gain = self.hit_rate(2.0) - self.hit_rate(1.0)
        if text is not None and gain >= self._logged_gain + RECOMMEND_GAIN / 2:
            log.warning("prompt cache: %s", text)
            self._logged_gain = gain


def attach_whatif(policy: EvictionPolicy, budget_bytes: int, block_size: int) -> WhatIf | None:
    """What-if simulations for a policy that follows them (``AdaptivePolicy``), else None."""
    from promptcache.core.policies.adaptive import AdaptivePolicy

    if not isinstance(policy, AdaptivePolicy):
        return None
    whatif = WhatIf(budget_bytes, block_size, policy.candidate_names)
    policy.whatif = whatif
    return whatif
