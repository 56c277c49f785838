"""Checks both engines' tests share: the same hit queries against a cached and an uncached engine."""

import random

HIT_LENGTHS = {"prefix": 45, "mid_block": 37, "supersequence": 28}  # positional layouts
# chunk boundaries (chunk 16), the base's last computed position (45 - 1) and its end
CHECKPOINTS = (16, 32, 44, 45)


def hit_results(cached, plain, logits_of, max_abs_diff):
    """Save a 45-token prompt, then run an exact, prefix, mid-block and supersequence query on
    both engines: (query kind, cached tokens, hit kind, max logit difference, same argmax)."""
    rng = random.Random(1)
    base = [rng.randrange(3, 256) for _ in range(45)]
    logits_of(cached, base)
    queries = {
        "exact": base,
        "prefix": base + [5, 6, 7, 8, 9, 10, 11],
        "mid_block": base[:37] + [9] * 10,
        "supersequence": base[:29],
    }
    out = []
    for name, query in queries.items():
        got, (num_cached, hit_kind) = logits_of(cached, query)
        want, _ = logits_of(plain, query)
        out.append(
            (name, num_cached, hit_kind, max_abs_diff(got, want), got.argmax() == want.argmax())
        )
    return out


def check_hit_lengths(name, num_cached, hit_kind, requires_checkpoint):
    assert num_cached > 0 and hit_kind == name, (name, num_cached, hit_kind)
    if requires_checkpoint:
        assert num_cached in CHECKPOINTS, "snapshot hits land on checkpoints"
        if name == "exact":  # a repeat reuses all but the last token, as on attention models
            assert num_cached == CHECKPOINTS[-2], num_cached
    elif name != "exact":
        assert num_cached == HIT_LENGTHS[name]


def token_ids(events):
    return [t for ev in events if hasattr(ev, "token_ids") for t in ev.token_ids]


def greedy_turns(cached, plain, params, num_turns=3):
    """A 30-token history; each turn both engines generate, then the history grows by the
    uncached engine's reply and 5 new tokens. Yields (turn, cached events, uncached events,
    length of the previous turn's prompt + reply)."""
    rng = random.Random(2)
    history = [rng.randrange(3, 256) for _ in range(30)]
    prev_len = 0
    for turn in range(num_turns):
        a = list(cached.generate(history, params))
        b = list(plain.generate(history, params))
        yield turn, a, b, prev_len
        prev_len = len(history) + len(b[-1].completion_ids)
        history = history + b[-1].completion_ids + [rng.randrange(3, 256) for _ in range(5)]
