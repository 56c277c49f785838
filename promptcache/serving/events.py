"""What a request asks for and what it yields: ``SamplingParams`` in, ``PrefillDone``, ``TextDelta``
and ``Finished`` out, and ``EngineLimits``. The serving loop builds them; ``engines.base`` (the
``Engine`` protocol the server sees) re-exports them as its vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from promptcache.core.stats import LookupReport
from promptcache.errors import RequestError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None  # an llguidance grammar the reply must follow (tools, JSON)
    forced_ids: tuple[int, ...] | None = None  # the reply's tokens, decided in advance (tests)
    timeout_s: float | None = None  # time budget from arrival; decoding stops when it runs out
    session: str = ""  # tagged on the cache blocks the request touches (inside its tenant)
    cache_ttl_s: float | None = None  # TTL hint for those blocks (None: the tiers' defaults)
    ignore_eos: bool = False  # an end-of-turn token does not end the reply (vLLM's; load tests)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0")


@dataclass(slots=True)
class PrefillDone:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    hit_kind: str
    lookup: LookupReport | None = None  # what the cache lookup found (None: cache off)
    phases: Any = None  # the request's PhaseTimes (its first_token_s is set just after)


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Finished:
    # "stop" | "length" | "context" (the context window is full) | "timeout" | "cancelled"
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str
    stop_sequence: str | None = None  # the stop string that ended generation, if one did
    completion_ids: list[int] = field(default_factory=list)  # every sampled token, EOS included


Event = PrefillDone | TextDelta | Finished


class EngineLimits(NamedTuple):
    """What an engine can take, for the server's checks (it never reaches into the engine)."""

    max_context: int  # tokens a sequence may hold: prompt + reply
    vocab_size: int  # token ids are in [0, vocab_size)
    block_size: int | None  # the prompt cache's block size; None: the cache is off
    supports_images: bool  # a vision-language model: image parts are taken
