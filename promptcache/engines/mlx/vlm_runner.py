"""MLX vision-language model runner: an mlx-vlm model (llava-style: plain RoPE positions, image
features in place of the image's placeholder token embeddings) on mlx-vlm's own KV cache, which
``mlx_state`` (with ``mlx_vlm_state``'s adapter) slices and restores per block like mlx-lm's.

``MlxVlmRunner`` keeps the ``ModelRunner`` contract on token ids (text chunks, decode batched
through mlx-vlm's ``BatchKVCache``, restore);
its ``vision`` (``MlxVision``, an ``serving.vision.VisionModel``) renders chats with image parts,
encodes one image at a time and runs chunks whose image positions take feature rows. Everything
goes through mlx-vlm's public processor and model methods (``get_input_embeddings``, the language
model's ``__call__`` with ``inputs_embeds`` and ``cache``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_vlm.models.cache import ArraysCache as VlmArraysCache
from mlx_vlm.models.cache import KVCache as VlmKVCache
from mlx_vlm.models.cache import make_prompt_cache

from promptcache.core.hashing import digest_bytes, fingerprint_model
from promptcache.core.images import ImageInput
from promptcache.engines.mlx.batch import batched_decode
from promptcache.engines.mlx.quant import MlxPacker
from promptcache.engines.mlx.state import (
    MlxCacheSteps,
    describe_cache,
    evaluate_module,
)
from promptcache.engines.mlx.vlm_load import model_package
from promptcache.engines.mlx.vlm_state import check_layers
from promptcache.errors import RequestError
from promptcache.serving.block_scheme import BlockScheme
from promptcache.serving.fingerprint import VOLATILE_CONFIG_KEYS, digest_weights
from promptcache.serving.layers import Layout
from promptcache.serving.vision import PlaceholderVision, VisionChunk

BATCHED = (VlmKVCache, VlmArraysCache)  # the cache kinds batched decode merges


def _config_of(model: Any) -> dict[str, Any]:
    config = model.config
    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    raw = dataclasses.asdict(config) if is_instance else {}
    return {k: v for k, v in raw.items() if k not in VOLATILE_CONFIG_KEYS}


def last_logits(
    language: Any,
    state: list[Any],
    ids: Sequence[int],
    embeds: Any,
    kwargs: Callable[[int, int], dict[str, Any]] | None = None,
) -> mx.array:
    """Run ``ids`` (with their ``embeds`` rows, or None: the token embeddings) on ``state``; the
    last position's logits. ``kwargs(a, b)``: extra model arguments for chunk positions [a, b)
    (e.g. positions). The lm head runs on the last position only: the first call's logits are
    never evaluated (MLX is lazy)."""
    tokens = mx.array([list(ids)])
    n = len(ids)
    if n > 1:
        head = None if embeds is None else embeds[:, :-1]
        extra = kwargs(0, n - 1) if kwargs is not None else {}
        language(tokens[:, :-1], inputs_embeds=head, cache=state, **extra)
        mx.eval([c.state for c in state])
    tail = None if embeds is None else embeds[:, -1:]
    extra = kwargs(n - 1, n) if kwargs is not None else {}
    logits = language(tokens[:, -1:], inputs_embeds=tail, cache=state, **extra).logits[0, -1]
    mx.eval(logits, [c.state for c in state])
    return logits


def image_rows(merged: mx.array, ids: Any, image_token_id: int, dtype: Any) -> mx.array:
    """The rows of ``merged`` (1, n, width) at the image token's positions in ``ids`` (1, n),
    cast to ``dtype`` and evaluated: an owning copy, as the vision cache keeps it."""
    where = mx.array(np.flatnonzero(np.asarray(ids)[0] == image_token_id))
    rows = merged[0][where].astype(dtype)
    mx.eval(rows)
    return rows


def spliced(language: Any, ids: Sequence[int], pieces: Sequence[tuple[int, Any]]) -> mx.array:
    """The token embeddings of ``ids`` with each piece's feature rows at its offset (the
    rows' first ``hidden`` columns: Qwen3-VL's carry deepstack columns after them)."""
    embeds = language.model.embed_tokens(mx.array(list(ids)))
    hidden = embeds.shape[-1]
    for offset, rows in pieces:
        embeds[offset : offset + rows.shape[0]] = rows[:, :hidden].astype(embeds.dtype)
    return embeds


class MlxVision(PlaceholderVision):
    """``VisionModel`` for an mlx-vlm llava-style model and its mlx-vlm processor."""

    def __init__(self, model: Any, processor: Any, dtype: Any) -> None:
        model_package(model.config.model_type)  # ConfigError for an unsupported architecture
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.dtype = dtype
        self.image_token = str(getattr(processor, "image_token", "<image>"))
        self.image_token_id = int(model.config.image_token_index)
        settings = {
            "model_type": model.config.model_type,
            "image_processor": processor.image_processor.to_dict(),
            "feature_layer": model.config.vision_feature_layer,
            "select": model.config.vision_feature_select_strategy,
            "patch_size": getattr(processor, "patch_size", None),
            "extra_tokens": getattr(processor, "num_additional_image_tokens", None),
        }
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()
        self.template = processor.chat_template or getattr(self.tokenizer, "chat_template", None)
        # tokens per image by (height, width): the processor decides from the size alone
        self._counts: dict[tuple[int, int], int] = {}

    def _process(self, image: ImageInput) -> Any:
        """The processor on one image and its placeholder alone: its ids (the placeholder
        expanded) and pixel values, as the model takes them."""
        try:
            return self.processor(images=[image.to_pil()], text=self.image_token)
        except Exception as exc:  # the client's image (a shape the processor cannot take)
            raise RequestError(f"the image processor refused an image: {exc}") from exc

    def num_tokens(self, image: ImageInput) -> int:
        size = (image.height, image.width)
        if size not in self._counts:  # a race computes it twice, with the same result
            ids = np.asarray(self._process(image)["input_ids"])
            self._counts[size] = int((ids == self.image_token_id).sum())
        return self._counts[size]

    def encode(self, image: ImageInput) -> mx.array:
        """One image's projected features (num_tokens, hidden), evaluated: the model's public
        ``get_input_embeddings`` on the processor's output for this image alone (its rows at
        the placeholder positions are what the model merges)."""
        inputs = self._process(image)
        ids = inputs["input_ids"]
        merged = self.model.get_input_embeddings(ids, inputs["pixel_values"]).inputs_embeds
        return image_rows(merged, ids, self.image_token_id, self.dtype)

    def forward(self, state: Any, chunk: VisionChunk) -> Any:
        # plain causal positions (llava): the chunk's place and the other images change nothing
        ids = chunk.ids
        embeds = spliced(self.model.language_model, ids, chunk.pieces)
        return last_logits(self.model.language_model, state, ids, embeds[None])


class MlxVlmRunner(MlxCacheSteps):
    """An mlx-vlm model and its processor (see ``ModelRunner``; ``vision`` takes images).
    ``block_scheme``: how positional blocks are stored at rest (part of the fingerprint)."""

    name = "mlx"

    def __init__(self, model: Any, processor: Any, block_scheme: BlockScheme | None = None) -> None:
        self.model = model
        evaluate_module(model)  # before any step runs on the stepping thread
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.language = model.language_model
        self.rope_scaling: dict[str, Any] | None = None
        state = self.new_state()
        check_layers(state)
        self.layout: Layout = describe_cache(state)
        self.block_scheme = block_scheme or BlockScheme()
        self.block_scheme.check()
        dtype = next(v for _, v in tree_flatten(model.parameters())).dtype
        self.packer = None if self.block_scheme.is_default else MlxPacker(self.block_scheme, dtype)
        self.fingerprint = fingerprint_model(
            _config_of(model),
            digest_weights(
                tree_flatten(model.parameters()), lambda a: np.asarray(a.astype(mx.float32))
            ),
            f"{dtype}:kv-full{self.block_scheme.tag}",
            "mlx-vlm",
        )
        eos = getattr(model.config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        text = model.config.text_config
        self.vocab_size = int(text.vocab_size)
        self.model_limit = int(getattr(text, "max_position_embeddings", None) or 2048)
        self.vision = self.make_vision(model, processor, dtype)

    def make_vision(self, model: Any, processor: Any, dtype: Any) -> Any:
        return MlxVision(model, processor, dtype)

    def new_state(self, num_positions: int = 0) -> list[Any]:
        return make_prompt_cache(self.language)

    def forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[mx.array]:
        # several one-token steps (decode): one forward through mlx-vlm's BatchKVCache (its
        # KVCache's public merge / extract, as mlx_batch does for mlx-lm); else one by one
        if all(len(x) == 1 for x in ids) and self.batches_decode(states):
            return batched_decode(self._batch_logits, states, [x[0] for x in ids])
        return [
            last_logits(self.language, state, seq_ids, None)
            for state, seq_ids in zip(states, ids, strict=True)
        ]

    def batches_decode(self, states: Sequence[Any]) -> bool:
        # mlx-vlm merges KV layers (BatchKVCache, left-padded) and linear-attention state
        # (ArraysCache rows stacked); sliding-window rings step one sequence per forward
        return len(states) > 1 and all(type(c) in BATCHED for c in states[0])

    def _batch_logits(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        return self.language(tokens, cache=cache).logits
