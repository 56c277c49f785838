"""One generation request between its steps: what it asked for, where it is, what it produced.

The scheduler moves a request through its phases one step at a time: a step returns what
happened (a ``Moved``: the next phase and the events for the consumer) and the scheduler alone
sets ``phase`` and fills ``outbox``, which the consumer's thread reads. Hot state: a slots
dataclass, no per-step allocation beyond the events and their ``Moved``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from promptcache.core.images import ImageSpan
from promptcache.core.lease import Lease
from promptcache.core.sequence import TokenSeq
from promptcache.serving.events import Event, SamplingParams
from promptcache.serving.forced import TokenConstraint
from promptcache.serving.textstream import StopTextStream


class Phase(enum.Enum):
    """Where a request is. Only the scheduler sets ``Request.phase``: a step returns the next
    phase (in its ``Moved``) and the scheduler applies it once the step is over."""

    NEW = "new"  # queued: not looked up yet
    PREFILL = "prefill"  # restored (or empty) state, prompt chunks left to run
    DECODE = "decode"  # PrefillDone sent; one token per step
    SAVE = "save"  # Finished sent; the final save (prompt + reply) is left
    DONE = "done"  # nothing left; the lease is released


@dataclass(slots=True)
class PhaseTimes:
    """Where a request's time to first token went, in seconds (``/v1/cache/requests`` shows
    it): waiting for its first step, the prompt lookup, restoring the hit into the model's
    cache, the prefill forwards and the saves between them, and sampling the first token."""

    queued_s: float = 0.0
    lookup_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    save_s: float = 0.0
    first_token_s: float = 0.0
    num_forwards: int = 0  # prefill forwards (pieces of chunks)

    def to_dict(self) -> dict[str, float]:
        names = ("queued", "lookup", "restore", "prefill", "save", "first_token")
        out = {n: round(getattr(self, n + "_s") * 1e3, 2) for n in names}
        return {**{n + "_ms": v for n, v in out.items()}, "num_forwards": self.num_forwards}


# what one request's part of a step came to: its next phase, or the error that ends it
Outcome = Phase | BaseException


class Moved(NamedTuple):
    """One request's part of a step, for the scheduler to apply: the events it produced (in
    order, for the consumer) go to the outbox, then ``outcome`` moves the phase."""

    outcome: Outcome
    events: list[Event] | tuple[()] = ()


@dataclass(slots=True, eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    tenant: str = ""
    cancel: threading.Event | None = None
    constraint: TokenConstraint | None = None  # a grammar or a forced reply
    deadline: float | None = None  # time.monotonic() when the time budget runs out
    t0: float = field(default_factory=time.perf_counter)  # arrival, for the TTFT
    images: tuple[ImageSpan, ...] = ()  # where the prompt's images sit (vision models only)
    phase: Phase = Phase.NEW  # the scheduler's alone (``_apply``)
    # the cache and the model state: written by ``steps.py`` inside a step (``in_flight``)
    seq: TokenSeq | None = None
    lease: Lease | None = None
    state: Any = None
    logits: Any = None  # the last forward's last-position logits
    pos: int = 0  # prompt tokens in ``state``
    features: dict[int, Any] = field(default_factory=dict)  # image rows by span, mid-prefill
    # decoding (``decoding.py``, inside a step; set up when the prefill ends)
    rng: np.random.Generator | None = None
    stream: StopTextStream | None = None
    generated: list[int] = field(default_factory=list)  # every sampled token, EOS included
    next_id: int = -1  # sampled, not yet emitted
    max_new: int = 0  # tokens the reply may have: max_tokens or the room left in the context
    length_reason: str = "length"  # the reason when max_new runs out: "length" or "context"
    # the batching policy's bookkeeping (``batching.py``, inside a step)
    waited: int = 0  # prompt tokens it waited for another in-flight request to prefill and save
    skipped: int = 0  # steps its prefill chunk did not fit the token budget (goes first next)
    # delivery: events for the consumer (an exception ends the request); the scheduler's alone
    outbox: deque[Event | BaseException] = field(default_factory=deque)
    in_flight: bool = False  # a step (or a settle) is working on it right now
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def cached(self) -> int:
        return self.lease.num_tokens if self.lease is not None else 0

    @property
    def hit_kind(self) -> str:
        return self.lease.kind if self.lease is not None else "off"

    @property
    def is_started(self) -> bool:
        """PrefillDone was sent: a timeout now ends the reply, not the request."""
        return self.phase is Phase.DECODE or self.phase is Phase.SAVE

    @property
    def is_cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def is_expired(self) -> bool:
        left = self.time_left()
        return left is not None and left <= 0

    def release(self) -> None:
        """Unpin the cached prefix (idempotent)."""
        if self.lease is not None:
            self.lease.release()
