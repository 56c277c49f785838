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
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq

log = logging.getLogger("promptcache.whatif")

FACTORS = (0.5, 1.0, 2.0)
LIVE = FACTORS.index(1.0)
MIN_SAMPLED_BLOCKS = 128  # in the 1x miniatures, which pick the leader
MIN_CURVE_BLOCKS = 64  # in the 0.5x miniatures, which only draw the curve
CURVE_RATE_FACTOR = 4  # the curve's miniatures sample 4x more sparsely
MAX_RATE = 64
# a challenger leads once it has this much more decayed hit rate (noise guard)
SWITCH_MARGIN = 0.002
RECOMMEND_GAIN = 0.05  # log a bigger budget when 2x would add this much hit rate


def _rate(budget_blocks: float, min_blocks: int, max_rate: int) -> int:
    """The largest power of two <= max_rate leaving at least ``min_blocks`` sampled blocks."""
    rate = 1
    while rate * 2 <= max_rate and budget_blocks / (rate * 2) >= min_blocks:
        rate *= 2
    return rate


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
        self.rates: list[int] = []  # R per factor; empty until a save tells the bytes per token
        self.thresholds: list[int] = []
        self.sims: list[list[MiniCache]] = []  # [factor][policy]
        self.scores = [[0.0] * len(self.policy_names) for _ in FACTORS]
        self.volumes = [0.0] * len(FACTORS)  # decayed sampled lookup blocks
        self.horizons = [1.0] * len(FACTORS)
        self._bytes = 0  # new bytes / new tokens saved: the live bytes per token
        self._tokens = 0
        self._block_bytes = 0
        self._chain_seq: TokenSeq | None = None
        self._chains: list[list[int]] = []
        self._lookups_since_log = 0
        self._logged_gain = 0.0

    @property
    def is_ready(self) -> bool:
        return bool(self.rates)

    # -- setup -------------------------------------------------------------------------------

    def _capacity_blocks(self, k: int) -> int:
        return max(1, round(self.budget_bytes * FACTORS[k] / (self._block_bytes * self.rates[k])))

    def note_saved(self, num_bytes: int, num_tokens: int) -> None:
        """New blocks were saved: learn the bytes a block of tokens takes (resizing the sims)."""
        if num_tokens <= 0:
            return
        self._bytes += num_bytes
        self._tokens += num_tokens
        block_bytes = max(1, round(self._bytes * self.block_size / self._tokens))
        if self.rates and abs(block_bytes - self._block_bytes) <= 0.02 * self._block_bytes:
            return
        self._block_bytes = block_bytes
        if self.rates:
            for k, row in enumerate(self.sims):
                for sim in row:
                    sim.resize(self._capacity_blocks(k))
            return
        budget_blocks = self.budget_bytes / block_bytes
        live = _rate(budget_blocks, MIN_SAMPLED_BLOCKS, MAX_RATE)
        curve = _rate(budget_blocks * min(FACTORS), MIN_CURVE_BLOCKS, live * CURVE_RATE_FACTOR)
        curve = min(max(curve, live), MAX_RATE)
        self.rates = [live if k == LIVE else curve for k in range(len(FACTORS))]
        self.thresholds = [256 // r for r in self.rates]
        self.sims = [
            [MiniCache(make_policy(p), self._capacity_blocks(k), self.block_size)
             for p in self.policy_names]
            for k in range(len(FACTORS))
        ]  # fmt: skip
        self.horizons = [max(32.0 * self._capacity_blocks(k), 4096.0) for k in range(len(FACTORS))]

    # -- the live request stream --------------------------------------------------------------

    def _sampled(self, seq: TokenSeq, num_blocks: int) -> list[list[BlockHash]]:
        """Per factor, the sampled full blocks among the first ``num_blocks`` of ``seq``."""
        hashes = seq.full_hashes()
        if seq is not self._chain_seq:  # a lookup and its saves share one sampling pass
            self._chain_seq = seq
            self._chains = sampled_indices(hashes, self.thresholds)
        return [[hashes[i] for i in chain if i < num_blocks] for chain in self._chains]

    def on_lookup(self, seq: TokenSeq) -> None:
        if not self.rates:
            return
        for k, chain in enumerate(self._sampled(seq, seq.num_full_blocks)):
            if not chain:
                continue
            keep = math.exp(-len(chain) / self.horizons[k])
            self.volumes[k] = self.volumes[k] * keep + len(chain)
            scores = self.scores[k]
            for j, sim in enumerate(self.sims[k]):
                scores[j] = scores[j] * keep + sim.lookup(chain)
        ones = self.scores[LIVE]
        best = max(range(len(ones)), key=ones.__getitem__)
        margin = SWITCH_MARGIN * self.volumes[LIVE]
        if best != self.leader and ones[best] > ones[self.leader] + margin:
            self.leader = best
            self.num_switches += 1
        self._lookups_since_log += 1
        if self._lookups_since_log >= 2000:
            self._lookups_since_log = 0
            self._maybe_recommend()

    def on_save(self, seq: TokenSeq, num_tokens: int) -> None:
        if not self.rates:
            return
        for chain, row in zip(
            self._sampled(seq, num_tokens // self.block_size), self.sims, strict=True
        ):
            for sim in row:
                sim.save(seq.root, chain)

    # -- results -----------------------------------------------------------------------------

    def hit_rate(self, factor: float, policy: int | None = None) -> float:
        """Estimated recent hit rate (of sampled full blocks) at ``factor`` x the budget: of one
        candidate, or of the best one (what the adaptive cache tends to)."""
        k = FACTORS.index(factor)
        if self.volumes[k] <= 0:
            return 0.0
        scores = self.scores[k]
        return (max(scores) if policy is None else scores[policy]) / self.volumes[k]

    def snapshot(self) -> dict[str, object]:
        return {
            "policy_leader": self.policy_names[self.leader],
            "whatif_sample_rate": 1 / self.rates[LIVE] if self.rates else 0.0,
            "whatif_sampled_lookup_blocks": round(self.volumes[LIVE], 1),
            "whatif_hit_rate_by_budget": {f"{f:g}x": round(self.hit_rate(f), 4) for f in FACTORS},
            "whatif_hit_rate_by_policy": {
                p: round(self.hit_rate(1.0, k), 4) for k, p in enumerate(self.policy_names)
            },
            "num_policy_switches": self.num_switches,
        }

    def recommendation(self) -> str | None:
        """A sentence when 2x the budget would clearly pay, after enough traffic to tell."""
        if min(self.volumes) < 0.5 * min(self.horizons):
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
