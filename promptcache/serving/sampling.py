"""Choosing the next token from last-position logits (numpy, for every engine)."""

from __future__ import annotations

import numpy as np

from promptcache.serving.events import SamplingParams


def sample_token(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None
) -> int:
    """Greedy at temperature 0; else temperature, top-k, then top-p (the first token that
    crosses top_p is kept), sampled with ``rng``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)
    # shift before dividing: a tiny temperature then gives -inf for all but the best, not NaN
    x = (x - x.max()) / params.temperature
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= params.top_p]] = 0.0
        probs /= probs.sum()
    rng = rng or np.random.default_rng()
    return int(rng.choice(probs.size, p=probs))
