"""Images on mlx-vlm's M-RoPE family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, Qwen3.5 and
its MoE, GLM-4V and its MoE): 3-D M-RoPE positions computed from where the prompt's images sit.

An image whose grid is (t, h, w) after the spatial merge takes t*h*w placeholder tokens; its
k-th token sits at (base + k // (h*w), base + k // w % h, base + k % w) in the (temporal, height,
width) rotary sections, ``base`` being the text position where it starts, and the text after it
continues from base + max(t, h, w): every later position is shifted by max(t, h, w) - t*h*w (the
rope delta). Positions are a pure function of the token index and the images before it (the
``ImagePlace``s the state keeps, set from the spans ``VisionModel.forward`` gets with each chunk
of a prompt with images), so chunked prefill, a prefix restored from the cache (a hit may end
inside or after an image) and decode are exact. Every forward passes ``position_ids`` explicitly: the library model's own
per-generation rope state is never read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from promptcache.core.hashing import digest_bytes
from promptcache.core.images import ImageInput, ImageSpan
from promptcache.engines.mlx.batch import batched_decode
from promptcache.engines.mlx.state import evaluate_module, get_slot
from promptcache.engines.mlx.vlm_runner import MlxVlmRunner, image_rows, last_logits, spliced
from promptcache.errors import ConfigError, RequestError
from promptcache.serving.vision import PlaceholderVision, VisionChunk


class ImagePlace(NamedTuple):
    start: int  # the image's first placeholder position in the prompt
    grid: tuple[int, int, int]  # (t, h, w) after the spatial merge: t*h*w tokens

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w


class MropeState(list[Any]):
    """mlx-vlm's per-layer cache list plus the images of the prompt it holds (``places``; a
    restored state has none until its first chunk; decode reads them)."""

    places: tuple[ImagePlace, ...] = ()


def mrope_positions(places: Sequence[ImagePlace], start: int, end: int) -> np.ndarray:
    """The (3, end - start) M-RoPE positions of prompt positions [start, end)."""
    out = np.empty((3, end - start), dtype=np.int32)
    shift, cursor = 0, start
    for place in places:
        p_end = place.start + place.length
        if place.start >= end:
            break
        if p_end > start:
            if place.start > cursor:  # text before the image
                out[:, cursor - start : place.start - start] = (
                    np.arange(cursor, place.start) + shift
                )
            lo, hi = max(place.start, start), min(p_end, end)
            _, h, w = place.grid
            k = np.arange(lo - place.start, hi - place.start)
            base = place.start + shift
            out[:, lo - start : hi - start] = base + np.stack([k // (h * w), k // w % h, k % w])
            cursor = hi
        shift += max(place.grid) - place.length
    if cursor < end:
        out[:, cursor - start :] = np.arange(cursor, end) + shift
    return out


class MropeVision(PlaceholderVision):
    """``VisionModel`` for an mlx-vlm Qwen-VL-family model and its mlx-vlm processor. Feature rows
    are the merged embeddings at the image's positions; Qwen3-VL's deepstack rows (added at its
    first decoder layers) ride along, concatenated on the hidden axis."""

    def __init__(self, model: Any, processor: Any, dtype: Any, offset_of: Callable) -> None:
        config = model.config
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.dtype = dtype
        self.offset_of = offset_of  # a state's token count
        self.image_token = str(processor.image_token)
        token_id = getattr(processor, "image_token_id", None)
        if token_id is None or self.tokenizer.convert_ids_to_tokens(token_id) != self.image_token:
            raise ConfigError(f"the tokenizer has no image token {self.image_token!r}")
        self.image_token_id = int(token_id)
        configured = getattr(config, "image_token_id", None) or getattr(
            config, "image_token_index", None
        )
        if configured is not None and int(configured) != self.image_token_id:
            raise ConfigError(
                f"the tokenizer's image token {self.image_token!r} is id {self.image_token_id}, "
                f"the model config's image token id is {configured}"
            )
        self.merge = int(config.vision_config.spatial_merge_size)
        self.hidden = int(config.text_config.hidden_size)
        settings = {
            "model_type": config.model_type,
            "image_processor": processor.image_processor.to_dict(),
            "merge": self.merge,
        }
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()
        self.template = processor.chat_template or getattr(self.tokenizer, "chat_template", None)
        # the merged grid by (height, width): the processor decides from the size alone
        self._grids: dict[tuple[int, int], tuple[int, int, int]] = {}

    def _process(self, image: ImageInput) -> dict[str, mx.array]:
        """The processor on one image and its placeholder alone: ids (the placeholder
        expanded), pixel values and the patch grid, as MLX arrays."""
        try:
            out = self.processor(images=[image.to_pil()], text=self.image_token)
        except Exception as exc:  # the client's image (a shape the processor cannot take)
            raise RequestError(f"the image processor refused an image: {exc}") from exc
        keys = ("input_ids", "pixel_values", "image_grid_thw")
        return {k: mx.array(np.asarray(out[k])) for k in keys}

    def grid(self, image: ImageInput) -> tuple[int, int, int]:
        size = (image.height, image.width)
        if size not in self._grids:  # a race computes it twice, with the same result
            t, h, w = (int(x) for x in np.asarray(self._process(image)["image_grid_thw"])[0])
            self._grids[size] = (t, h // self.merge, w // self.merge)
        return self._grids[size]

    def num_tokens(self, image: ImageInput) -> int:
        return ImagePlace(0, self.grid(image)).length

    def place(self, state: MropeState, spans: Sequence[ImageSpan]) -> None:
        places = tuple(ImagePlace(s.start, self.grid(s.image)) for s in spans)
        for span, p in zip(spans, places, strict=True):
            if p.length != span.length:
                raise ValueError(f"an image of {span.length} tokens has grid {p.grid}")
        state.places = places

    def encode(self, image: ImageInput) -> mx.array:
        """One image's rows (num_tokens, hidden * (1 + deepstack layers)), evaluated: the
        model's public ``get_input_embeddings`` on the processor's output for this image alone."""
        inputs = self._process(image)
        ids = inputs["input_ids"]
        features = self.model.get_input_embeddings(
            ids, inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        )
        rows = image_rows(features.inputs_embeds, ids, self.image_token_id, self.dtype)
        # GLM-4V keeps this call's rope index on the model (never read: positions are passed):
        # evaluated here, on this thread, so no array on the model waits for this thread's stream
        evaluate_module(self.model)
        deep = getattr(features, "deepstack_visual_embeds", None)
        if deep:  # one (num_tokens, hidden) array per deepstack layer, in image-token order
            rows = mx.concatenate([rows, *(d.astype(self.dtype) for d in deep)], axis=-1)
            mx.eval(rows)
        return rows

    def forward(self, state: Any, chunk: VisionChunk) -> Any:
        ids, pieces, start, spans = chunk
        # every chunk of a prompt with images comes here: the state learns where they sit
        self.place(state, spans)
        if start != self.offset_of(state):
            raise ValueError(f"a chunk at {start} on a state of {self.offset_of(state)} tokens")
        language = self.model.language_model
        embeds = spliced(language, ids, pieces)
        visual = np.zeros(len(ids), dtype=bool)
        deep: list[list[mx.array]] = []
        for offset, rows in pieces:
            visual[offset : offset + rows.shape[0]] = True
            extra = rows.shape[-1] // self.hidden - 1
            deep.append(
                [rows[:, (k + 1) * self.hidden : (k + 2) * self.hidden] for k in range(extra)]
            )
        stacks = [mx.concatenate(list(parts)) for parts in zip(*deep, strict=True)]
        return run_chunk(language, state, start, ids, embeds[None],
                         (visual, stacks) if stacks else None)  # fmt: skip


def run_chunk(
    language: Any,
    state: MropeState,
    start: int,
    ids: Sequence[int],
    embeds: Any,
    deepstack: tuple[np.ndarray, list[mx.array]] | None = None,
) -> mx.array:
    """Prompt positions [start, start + len(ids)) on ``state`` with their M-RoPE positions (and
    Qwen3-VL's deepstack rows: a visual mask over the chunk, one stacked array per layer)."""
    positions = mrope_positions(state.places, start, start + len(ids))

    def kwargs(a: int, b: int) -> dict[str, Any]:
        out: dict[str, Any] = {"position_ids": mx.array(positions[:, None, a:b])}
        if deepstack is not None and deepstack[0][a:b].any():
            visual, stacks = deepstack
            lo, hi = int(visual[:a].sum()), int(visual[:b].sum())
            out["visual_pos_masks"] = mx.array(visual[None, a:b])
            out["deepstack_visual_embeds"] = [s[lo:hi] for s in stacks]
        return out

    return last_logits(language, state, ids, embeds, kwargs)


class MropeRunner(MlxVlmRunner):
    """``MlxVlmRunner`` for the Qwen-VL family: states are ``MropeState``s, every forward passes
    explicit M-RoPE positions; Qwen3.5's linear-attention layers are snapshot state."""

    def make_vision(self, model: Any, processor: Any, dtype: Any) -> MropeVision:
        return MropeVision(model, processor, dtype, self.num_tokens_of)

    def new_state(self, num_positions: int = 0) -> MropeState:
        return MropeState(super().new_state(num_positions))

    def num_tokens_of(self, state: list[Any]) -> int:
        return int(get_slot(state, self.layout.positional[0]).offset)

    def crop(self, state: list[Any], length: int) -> None:
        super().crop(state, length)
        # images from ``length`` on are another prompt's: a later request sets its own
        assert isinstance(state, MropeState)
        state.places = tuple(p for p in state.places if p.start < length)

    def forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[mx.array]:
        if all(len(x) == 1 for x in ids) and self.batches_decode(states):
            rows = [mrope_positions(s.places, n, n + 1) for s in states
                    for n in [self.num_tokens_of(s)]]  # fmt: skip
            positions = mx.array(np.stack(rows, axis=1))  # (3, batch, 1)

            def step(tokens: mx.array, cache: list[Any]) -> mx.array:
                return self.language(tokens, cache=cache, position_ids=positions).logits

            return batched_decode(step, states, [x[0] for x in ids])
        return [
            run_chunk(self.language, state, self.num_tokens_of(state), seq_ids, None)
            for state, seq_ids in zip(states, ids, strict=True)
        ]
