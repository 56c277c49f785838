"""Next-token sampling shared by every engine."""

import numpy as np

from promptcache.engines.base import SamplingParams
from promptcache.serving.sampling import sample_token


def test_greedy_top_k_and_top_p_limits():
    logits = np.array([0.1, 3.0, 2.9, -1.0, 2.8], dtype=np.float32)
    assert sample_token(logits, SamplingParams(), None) == 1
    rng = np.random.default_rng(0)
    hot = SamplingParams(temperature=5.0)
    assert {sample_token(logits, hot, rng) for _ in range(300)} == {0, 1, 2, 3, 4}
    top2 = SamplingParams(temperature=5.0, top_k=2)
    assert {sample_token(logits, top2, rng) for _ in range(300)} == {1, 2}
    # top_p keeps the smallest head whose mass reaches p, always at least the first token
    narrow = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample_token(logits, narrow, rng) for _ in range(100)} == {1}
    half = SamplingParams(temperature=1.0, top_p=0.5)
    assert {sample_token(logits, half, rng) for _ in range(300)} == {1, 2}


def test_seeded_sampling_repeats():
    logits = np.linspace(0, 1, 50).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    a = [sample_token(logits, p, np.random.default_rng(7)) for _ in range(5)]
    b = [sample_token(logits, p, np.random.default_rng(7)) for _ in range(5)]
    assert a == b
