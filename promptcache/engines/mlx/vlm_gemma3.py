"""Images on mlx-vlm's Gemma 3: an image's soft tokens attend to each other (bidirectionally, as
the model was trained and as transformers runs it), every other position causally.

The template's ``<start_of_image>`` expands as mlx-vlm's processor expands it (blank lines, the
boi token, ``image_seq_length`` soft tokens, the eoi token). ``whole_images``: a prefill chunk
holds all of an image or none of it (the engine moves chunk ends past images), so the image
block of the mask always lies inside one chunk; a hit may still end inside an image, its rows
having been computed whole. Chunks without image tokens and decode run mlx-vlm's own forward;
a chunk holding an image runs the same layers with per-layer masks: each layer cache's own
``make_mask`` (causal, windowed for the sliding layers' rings) with the image block added.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from promptcache.core.hashing import digest_bytes
from promptcache.core.images import ImageInput
from promptcache.engines.mlx.vlm_runner import MlxVlmRunner, image_rows, last_logits, spliced
from promptcache.errors import ConfigError, RequestError
from promptcache.serving.vision import PlaceholderVision, VisionChunk


class Gemma3Vision(PlaceholderVision):
    """``VisionModel`` for an mlx-vlm Gemma 3 and its mlx-vlm ``Gemma3Processor``."""

    whole_images = True

    def __init__(self, model: Any, processor: Any, dtype: Any) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.dtype = dtype
        self.boi = self.marker = str(processor.boi_token)  # the template's mark per image
        self.sequence = str(processor.full_image_sequence)
        self.image_token_id = int(processor.image_token_id)
        self.length = int(processor.image_seq_length)
        if int(model.config.image_token_index) != self.image_token_id:
            raise ConfigError("the tokenizer's image token is not the model config's")
        images = processor.image_processor
        if getattr(images, "do_pan_and_scan", False):  # crops change the prompt per image
            raise ConfigError("Gemma 3 pan-and-scan crops are not supported")
        settings = {"model_type": "gemma3", "image_processor": images.to_dict(),
                    "length": self.length}  # fmt: skip
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()
        self.template = processor.chat_template or getattr(self.tokenizer, "chat_template", None)

    def num_tokens(self, image: ImageInput) -> int:
        return self.length

    def encode(self, image: ImageInput) -> mx.array:
        """One image's rows (image_seq_length, hidden), evaluated: the model's public
        ``get_input_embeddings`` on the processor's output for this image alone."""
        try:
            out = self.processor(images=[image.to_pil()], text=self.boi)
        except Exception as exc:  # the client's image (a shape the processor cannot take)
            raise RequestError(f"the image processor refused an image: {exc}") from exc
        ids = mx.array(np.asarray(out["input_ids"]))
        pixels = mx.array(np.asarray(out["pixel_values"]))
        merged = self.model.get_input_embeddings(ids, pixels, mask=mx.ones_like(ids))
        return image_rows(merged.inputs_embeds, ids, self.image_token_id, self.dtype)

    def forward(self, state: Any, chunk: VisionChunk) -> Any:
        ids, pieces = chunk.ids, chunk.pieces
        language = self.model.language_model
        if not pieces:  # text only: the library's own forward and masks
            return last_logits(language, state, ids, None)
        embeds = spliced(language, ids, pieces)
        group = np.full(len(ids), -1)
        for k, (offset, rows) in enumerate(pieces):
            group[offset : offset + rows.shape[0]] = k
        block = mx.array((group[:, None] == group[None, :]) & (group[:, None] >= 0))
        return self._with_image_masks(state, embeds[None], block)

    def _with_image_masks(self, state: list[Any], embeds: mx.array, block: mx.array) -> mx.array:
        """Gemma3Model's layers on one chunk, each with its cache's causal mask (windowed on the
        sliding layers) plus ``block`` (same-image pairs) on the chunk's own columns."""
        text = self.model.language_model.model
        config = text.config
        n = embeds.shape[1]
        h = embeds
        if getattr(text, "scale_inputs_embeds", True):  # as Gemma3Model scales given embeddings
            h = h * mx.array(config.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        pattern = config.sliding_window_pattern
        for i, (layer, c) in enumerate(zip(text.layers, state, strict=True)):
            window = None if i % pattern == pattern - 1 else config.sliding_window
            mask = c.make_mask(n, window_size=window, return_array=True)
            keys = mask.shape[-1]
            mask = mx.concatenate([mask[:, : keys - n], mask[:, keys - n :] | block], axis=1)
            h = layer(h, mask, c)
        logits = self.model.language_model.lm_head(text.norm(h[:, -1:]))[0, -1]
        mx.eval(logits, [c.state for c in state])
        return logits


class Gemma3Runner(MlxVlmRunner):
    """``MlxVlmRunner`` for Gemma 3: its sliding-window layers are mlx-vlm's ``RotatingKVCache``
    (snapshot state), so decode runs one sequence per forward."""

    def make_vision(self, model: Any, processor: Any, dtype: Any) -> Gemma3Vision:
        return Gemma3Vision(model, processor, dtype)
