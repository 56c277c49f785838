"""What every engine offers the server: one request in, a stream of events out.

The error types live in ``errors.py``, the request's parameters and events in
``serving/events.py``; both are re-exported here as the protocol's vocabulary."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from promptcache.core.admin import CacheAdmin
from promptcache.core.figures import Series
from promptcache.core.images import ImageInput, ImageSpan
from promptcache.errors import (
    CacheSaveError,
    ConfigError,
    EngineError,
    EngineFailure,
    EngineTimeoutError,
    PromptTooLongError,
    RequestError,
)
from promptcache.serving.events import (
    EngineLimits,
    Event,
    Finished,
    PrefillDone,
    SamplingParams,
    TextDelta,
)

__all__ = [
    "CacheSaveError",
    "ConfigError",
    "CacheAdmin",
    "Engine",
    "EngineError",
    "EngineLimits",
    "EngineFailure",
    "EngineTimeoutError",
    "Event",
    "Finished",
    "PrefillDone",
    "PromptTooLongError",
    "RequestError",
    "SamplingParams",
    "TextDelta",
]


class Engine(Protocol):
    """What the server uses. Errors: ``RequestError`` (and its ``PromptTooLongError``,
    ``EngineTimeoutError``) for requests that cannot be served as asked, ``EngineFailure`` for
    faults of the engine or its cache; both raised before the first event or from the stream."""

    name: str
    model_id: str
    model_type: str  # the model config's model_type ("" when it has none)
    fingerprint: str  # the model's identity (weights, config, dtype, block scheme)
    eos_ids: set[int]
    tokenizer: Any  # an HF-style tokenizer (chat template, encode, decode)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt token ids for a chat via the model's chat template (generation prompt added);
        ``template_kwargs`` (``enable_thinking``...) go to the template as variables."""

    @property
    def supports_images(self) -> bool:
        """True for a vision-language model (``encode_chat_images`` and ``images=`` work)."""

    def encode_chat_images(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: list[ImageInput],
    ) -> tuple[list[int], list[ImageSpan]]:
        """Like ``encode_chat`` for messages whose content may hold ``{"type": "image"}``
        parts (``images`` in their order): the ids and one span per image. RequestError on a
        text-only model or an image the processor refuses."""

    def encode_text(self, text: str) -> list[int]:
        """Prompt token ids for a raw completion prompt."""

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""

    def make_constraint(self, grammar: str) -> Any:
        """A fresh grammar state for one request (raises RequestError on a bad grammar)."""

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        cancel: threading.Event | None = None,
        images: tuple[ImageSpan, ...] | list[ImageSpan] = (),
    ) -> Iterator[Event]:
        """Prefill (reusing the cache), then decode. Yields PrefillDone once, TextDelta per
        piece of text and Finished last. Raises RequestError before the first event on bad input.
        ``images``: where the prompt's images sit (from ``encode_chat_images``).
        Setting ``cancel`` stops decoding at the next token and still yields Finished."""

    @property
    def limits(self) -> EngineLimits:
        """Its context, vocabulary, cache block and image support in one record."""

    @property
    def cache_admin(self) -> CacheAdmin | None:
        """The handle to administer its prompt cache (deletions, warm-up, budget); None when
        the cache is off. The server never touches the cache itself."""

    def cache_stats(self) -> dict[str, Any]:
        """The prompt cache's counters as JSON-ready values (empty when the cache is off)."""

    def cache_series(self) -> list[Series]:
        """The same figures for ``/metrics``, each with its kind and label, named by family
        (``cache_num_hits``, ``memory_rss_bytes``, ``vision_encoder_runs``)."""

    def forget_images(self, tenant: str, session: str | None, force: bool = False) -> int:
        """Remove the cached encoder outputs of a deleted session's images (``session`` None: a
        whole tenant's), like its blocks: shared ones stay unless ``force``. Returns how many
        went (0 for a text-only model); safe to call twice."""

    def close(self) -> None:
        """Flush and release the cache tiers; safe to call twice."""
