"""Decoding one token of a request: sample (grammar-masked), stream text, and decide whether the
reply ends: EOS, a stop string, a complete grammar, the token budget, the context or a cancel.
The deadline and the model forward are the step's (``steps.py``); this is per-token bookkeeping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from promptcache.serving.events import Event, Finished, SamplingParams, TextDelta
from promptcache.serving.forced import TokenConstraint
from promptcache.serving.request import Request
from promptcache.serving.sampling import sample_token
from promptcache.serving.textstream import StopTextStream


def sample_next(
    scores: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator | None,
    constraint: TokenConstraint | None,
) -> int:
    if constraint is not None:
        scores = constraint.mask(scores)
    return sample_token(scores, params, rng)


def start_decoding(
    req: Request, max_context: int, decode_text: Callable[[list[int]], str], scores: np.ndarray
) -> None:
    """After the prefill: the seeded generator, the text stream, the budget, the first token
    sampled from the prompt's last logits (``scores``)."""
    params = req.params
    seed = params.seed
    req.rng = np.random.default_rng(seed % 2**64) if seed is not None else None
    room = max_context - req.num_prompt
    req.max_new = min(params.max_tokens, room)
    req.length_reason = "length" if params.max_tokens <= room else "context"
    req.stream = StopTextStream(decode_text, params.stop)
    req.next_id = sample_next(scores, params, req.rng, req.constraint)


def sample_after(req: Request, scores: np.ndarray) -> None:
    """The next token from the logits of the last emitted one."""
    req.next_id = sample_next(scores, req.params, req.rng, req.constraint)


def emit_token(req: Request, eos_ids: Any, events: list[Event]) -> str | None:
    """The sampled token's turn: a cancel drops it, else it joins the reply (a TextDelta into
    the step's ``events``). Returns why the reply ends here, or None to go on."""
    if req.is_cancelled:
        return "cancelled"
    token = req.next_id
    req.generated.append(token)
    if token in eos_ids:
        if not req.params.ignore_eos:
            return "stop"
        # kept in the sequence, never in the text: the reply goes on to its length (a
        # constraint still sees it, and a grammar that ends there ends the reply)
        if req.constraint is not None:
            req.constraint.accept(token)
            if req.constraint.is_stopped:
                return "stop"
        return req.length_reason if len(req.generated) >= req.max_new else None
    assert req.stream is not None
    delta = req.stream.push(token)
    if delta:
        events.append(TextDelta(delta, [token]))
    constraint = req.constraint
    if constraint is not None:
        constraint.accept(token)
    if req.stream.stopped or (constraint is not None and constraint.is_stopped):
        return "stop"
    if len(req.generated) >= req.max_new:
        return req.length_reason
    return None


def finish_reply(req: Request, reason: str, events: list[Event]) -> None:
    """The held-back text, then Finished, into the step's ``events`` (a request cancelled before
    decoding has no reply)."""
    stream = req.stream
    if stream is None:
        events.append(Finished(reason, req.num_prompt, 0, req.cached, ""))
        return
    tail = stream.flush()
    if tail:
        events.append(TextDelta(tail, []))
    events.append(
        Finished(
            reason,
            req.num_prompt,
            len(req.generated),
            req.cached,
            stream.text,
            stream.matched_stop,
            list(req.generated),
        )
    )
