"""Recompute-cost-aware frecency: a block's value is how often it is used times what a miss on
it costs to recompute, which a prompt cache knows and a generic cache does not: a block at depth
p tokens attends over the p tokens before it, so recomputing it costs ``1 + p / C`` per token
(``replay.prefill_cost``; ``C`` about 6x the model's hidden size).

Priority ``t + W * ln(f * cost)``, lowest first: frecency's rule (``t`` the last use, ``f`` the
uses, ``W`` a few typical reuse intervals) with the cost folded into the frequency, as in
GreedyDual-Size-Frequency (Cherkasova 1998): a block twice as dear to recompute is kept as long
as one used twice as often. With ``cost = 1`` everywhere this is frecency. It optimizes compute
saved, not hit rate: on hit rate it may lose a little to frecency by keeping deep tails.
"""

from __future__ import annotations

import math

from promptcache.core.block import Block
from promptcache.core.policies.frecency import FrecencyPolicy
from promptcache.core.policy import register_policy

ATTENTION_CONTEXT = 24_576  # C: the depth at which attention costs as much as the linear layers


class RecomputePolicy(FrecencyPolicy):
    name = "recompute"

    def __init__(self, attention_context: float = ATTENTION_CONTEXT) -> None:
        super().__init__()
        self.attention_context = attention_context

    def _priority(self, block: Block, last: int, freq: int) -> float:
        # the block's mean token position: its depth plus half its own tokens
        cost = 1.0 + (block.meta.depth + block.meta.num_tokens / 2) / self.attention_context
        return last + self._window * math.log(freq * cost)


register_policy("recompute")(RecomputePolicy)
