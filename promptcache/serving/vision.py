"""Images through an engine: the ``VisionModel`` protocol a vision-language runner offers, and
``VisionFeeder``, which prefills the chunks that hold image tokens.

A runner for a vision-language model keeps its usual contract (``forward`` on token ids runs
text-only chunks, decode, and every restore) and adds ``vision``, a ``VisionModel``: the chat
template with each image's placeholder expanded to its token count, the encoder (image ->
feature rows that replace those placeholders' embeddings) and a forward on token ids whose
image positions take feature rows. Images enter the cache key through the block extras
(``core.images.image_extras``); a hit that reaches past an image needs no encoder at all, and a
chunk that holds image tokens gets its feature rows from the vision-embedding cache
(``core.vision_cache``) or, on a miss, from one encoder run (counted).

Every prefill chunk of a prompt with images goes through ``VisionModel.forward`` (with the
chunk's absolute start and all the prompt's spans), image tokens in it or not: a model whose
positions depend on the images before them (Qwen-VL's 3-D RoPE) needs them after a restore too.
A model whose image tokens attend to each other (``whole_images``: Gemma 3's bidirectional
image attention) never has a chunk end inside an image (``image_safe_end``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from promptcache.core.figures import Series, Snapshot
from promptcache.core.images import ImageInput, ImageSpan
from promptcache.core.vision_cache import VisionCache, VisionKey
from promptcache.errors import RequestError


class VisionChunk(NamedTuple):
    """One prefill chunk of a prompt with images, as ``VisionModel.forward`` runs it: the token
    ``ids`` at prompt positions [start, start + len(ids)), the feature rows that replace the
    embeddings at offsets ``pieces[k][0] ..`` of the chunk (``pieces[k][1]``; empty: a chunk
    that holds no image token) and ``spans``, all the prompt's images."""

    ids: Sequence[int]
    pieces: Sequence[tuple[int, Any]]
    start: int = 0
    spans: Sequence[ImageSpan] = ()


class VisionModel(Protocol):
    """The image half of a vision-language runner. Contract: ``render`` and ``num_tokens`` are
    cheap and thread-safe (the server calls them on its threads); ``encode`` and ``forward``
    run inside engine steps only. Feature rows are library arrays, shape (num_tokens, hidden),
    owning copies (they are cached and shared between requests)."""

    settings_key: str  # what besides the weights shapes encode()'s output (processor settings)
    image_token_id: int  # the placeholder token id repeated over an image's positions
    # an image's tokens attend to each other (bidirectionally): a prefill chunk holds all of an
    # image or none of it (a hit may still end inside one: its rows were computed whole)
    whole_images: bool

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: Sequence[ImageInput],
    ) -> tuple[list[int], list[ImageSpan]]:
        """Prompt ids of a chat whose content parts may be ``{"type": "image"}`` (``images`` in
        the order those parts appear), generation prompt added, each image's placeholder
        expanded to its token count; one span per image, in order. Raises RequestError on a
        template error or an image the processor refuses."""

    def encode(self, image: ImageInput) -> Any:
        """The feature rows replacing the image's placeholders: (num_tokens, hidden)."""

    def forward(self, state: Any, chunk: VisionChunk) -> Any:
        """Run the chunk's ids on ``state`` (appending to it) like ``ModelRunner.forward`` for
        one sequence, its image tokens' embeddings replaced by its feature rows. The last
        position's logits."""


class VisionFeeder:
    """Feature rows for prefill chunks: from ``cache`` (None: no embedding cache) or the
    encoder. ``num_encoder_runs`` counts images actually encoded."""

    def __init__(self, vision: VisionModel, fingerprint: str, cache: VisionCache | None) -> None:
        self.vision = vision
        self.fingerprint = fingerprint
        self.cache = cache
        self._lock = threading.Lock()
        self.num_encoder_runs = 0
        self.num_images_fed = 0  # images whose rows went into a prefill chunk

    def features(self, image: ImageInput, tenant: str = "", session: str = "") -> Any:
        key = VisionKey(self.fingerprint, self.vision.settings_key, image.digest, tenant)
        if self.cache is not None:
            rows = self.cache.get(key, session)
            if rows is not None:
                return rows
        rows = self.vision.encode(image)
        with self._lock:
            self.num_encoder_runs += 1
        if self.cache is not None:
            self.cache.put(key, rows, session)
        return rows

    def forward_chunk(
        self,
        state: Any,
        ids: Sequence[int],
        start: int,
        spans: Sequence[ImageSpan],
        held: dict[int, Any],
        tenant: str = "",
        session: str = "",
    ) -> Any:
        """Prefill prompt positions [start, start + len(ids)) of a prompt whose images are
        ``spans``. ``held``: the request's feature rows by span index (kept while an image spans
        several chunks); cached per ``tenant``, tagged with ``session``."""
        end = start + len(ids)
        pieces: list[tuple[int, Any]] = []
        for i, span in enumerate(spans):
            lo, hi = max(span.start, start), min(span.end, end)
            if lo >= hi:
                continue
            rows = held.get(i)
            if rows is None:
                rows = held[i] = self.features(span.image, tenant, session)
                with self._lock:
                    self.num_images_fed += 1
            if int(rows.shape[0]) != span.length:
                raise ValueError(
                    f"the encoder gave {rows.shape[0]} rows for an image of {span.length} tokens"
                )
            pieces.append((lo - start, rows[lo - span.start : hi - span.start]))
            if hi == span.end:  # the image is done: its rows stay in the cache, not the request
                held.pop(i, None)
        return self.vision.forward(state, VisionChunk(ids, pieces, start, spans))

    def forget(self, tenant: str, session: str | None, force: bool = False) -> int:
        """Encoder outputs of a deleted session (None: of a whole tenant); how many went."""
        if self.cache is None:
            return 0
        if session is None:
            return self.cache.forget_tenant(tenant)
        return self.cache.forget_session(tenant, session, force)

    def stats(self) -> Snapshot:
        with self._lock:
            runs = {"encoder_runs": self.num_encoder_runs, "images_fed": self.num_images_fed}
        series = [Series(k, "counter", v) for k, v in runs.items()]
        values: dict[str, Any] = {**runs, "cache_enabled": self.cache is not None}
        if self.cache is not None:  # flat: /metrics shows promptcache_vision_cache_*
            cache = self.cache.stats()
            values.update({f"cache_{k}": v for k, v in cache.items()})
            series += [s.renamed("cache_") for s in cache.series()]
        return Snapshot(values, tuple(series))


class PlaceholderVision:
    """A base for ``VisionModel`` classes whose template marks each image: ``render`` renders
    the chat, then expands each mark to the image's ``num_tokens`` image tokens. The mark is
    the image token itself (llava, Qwen-VL: expanded after tokenizing), or, with ``marker``, a
    text the processor replaces by the whole image ``sequence`` (Gemma 3: blank lines,
    ``<start_of_image>``, the soft tokens, ``<end_of_image>``; expanded before tokenizing, as
    the processor does, so the tokenizer's merges around it are its own)."""

    tokenizer: Any
    template: str | None
    image_token_id: int
    whole_images = False
    marker: str | None = None
    sequence: str = ""

    def num_tokens(self, image: ImageInput) -> int:
        """How many image-token positions ``image`` takes in the prompt."""
        raise NotImplementedError

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: Sequence[ImageInput],
    ) -> tuple[list[int], list[ImageSpan]]:
        text = chat_text(self.tokenizer, self.template, messages, tools)
        if self.marker is not None:
            return self._expand_markers(text, images, self.marker)
        return self._expand_placeholders(text, images)

    def _expand_placeholders(
        self, text: str, images: Sequence[ImageInput]
    ) -> tuple[list[int], list[ImageSpan]]:
        """Tokenize, then expand the k-th image token to ``num_tokens(images[k])`` copies."""
        token = self.image_token_id
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        marks = [i for i, t in enumerate(ids) if t == token]
        if len(marks) != len(images):
            raise RequestError(
                f"the prompt holds {len(marks)} image placeholders for {len(images)} images "
                "(the text may not contain the model's image token)"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for mark, image in zip(marks, images, strict=True):
            out += ids[prev:mark]
            n = self.num_tokens(image)
            spans.append(ImageSpan(len(out), n, image))
            out += [token] * n
            prev = mark + 1
        return out + ids[prev:], spans

    def _expand_markers(
        self, text: str, images: Sequence[ImageInput], marker: str
    ) -> tuple[list[int], list[ImageSpan]]:
        """Replace each ``marker`` by ``sequence``, then tokenize the text once."""
        token = self.image_token_id
        if text.count(marker) != len(images) or self.sequence.count(marker) != 1:
            raise RequestError(
                f"the prompt holds {text.count(marker)} image markers for {len(images)} images "
                "(the text may not contain the model's image tokens)"
            )
        ids = list(
            self.tokenizer.encode(text.replace(marker, self.sequence), add_special_tokens=False)
        )
        starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
        spans = [
            ImageSpan(s, self.num_tokens(im), im) for s, im in zip(starts, images, strict=False)
        ]
        if len(starts) != len(images) or any(
            ids[s.start : s.end] != [token] * s.length for s in spans
        ):
            raise RequestError("the prompt's image tokens do not match its images")
        return ids, spans


def chat_text(
    tokenizer: Any, template: str | None, messages: list[dict[str, Any]], tools: Any
) -> str:
    """The chat's prompt text through ``template`` (generation prompt added), image parts left
    as the template writes them; RequestError on a template error (the client's messages)."""
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=template, add_generation_prompt=True,
                tokenize=False,
            )
        )  # fmt: skip
    except Exception as exc:  # template errors are the client's (bad roles, bad parts)
        raise RequestError(f"cannot apply the chat template: {exc}") from exc


def image_safe_end(spans: Sequence[ImageSpan], end: int) -> int:
    """``end`` moved past the image it would cut (a chunk of a ``whole_images`` model)."""
    for span in spans:
        if span.start < end < span.end:
            return span.end
    return end


def overlaps(spans: Sequence[ImageSpan], start: int, end: int) -> bool:
    return any(s.start < end and start < s.end for s in spans)
