"""The decode loop after a prefill: sample, stream text, stop on EOS, stop strings, a complete
grammar, the token budget, the context, a cancel or the request's deadline."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from promptcache.engines.base import Finished, SamplingParams, TextDelta
from promptcache.engines.grammar import GrammarConstraint
from promptcache.engines.sampling import sample_token
from promptcache.engines.textstream import StopTextStream
from promptcache.engines.turns import StepTimeout


def sample_next(
    scores: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator | None,
    constraint: GrammarConstraint | None,
) -> int:
    if constraint is not None:
        scores = constraint.mask(scores)
    return sample_token(scores, params, rng)


def decode_reply(
    engine: Any,
    state: Any,
    logits: Any,
    num_prompt: int,
    num_cached: int,
    params: SamplingParams,
    constraint: GrammarConstraint | None,
    step: Callable[[], AbstractContextManager[Any]],
    is_cancelled: Callable[[], bool],
) -> Iterator[TextDelta | Finished]:
    """Yields TextDelta per piece of text, then Finished. ``step()`` is one turn on the engine
    (it raises StepTimeout once the deadline passed); ``logits`` are the prompt's last."""
    seed = params.seed
    rng = np.random.default_rng(seed % 2**64) if seed is not None else None
    room = engine.max_context - num_prompt
    max_new = min(params.max_tokens, room)
    stream = StopTextStream(engine.decode, params.stop)
    generated: list[int] = []
    reason = "length" if params.max_tokens <= room else "context"
    next_id = sample_next(engine.to_numpy(logits), params, rng, constraint)
    for index in range(max_new):
        if is_cancelled():
            reason = "cancelled"
            break
        generated.append(next_id)
        if next_id in engine.eos_ids:
            reason = "stop"
            break
        delta = stream.push(next_id)
        if delta:
            yield TextDelta(delta, [next_id])
        if constraint is not None:
            constraint.accept(next_id)
        if stream.stopped or (constraint is not None and constraint.is_stopped):
            reason = "stop"
            break
        if index == max_new - 1:
            break
        try:
            with step():
                logits = engine.forward(state, [next_id])
        except StepTimeout:
            reason = "timeout"
            break
        next_id = sample_next(engine.to_numpy(logits), params, rng, constraint)
    tail = stream.flush()
    if tail:
        yield TextDelta(tail, [])
    yield Finished(
        reason, num_prompt, len(generated), num_cached, stream.text, stream.matched_stop, generated
    )
