"""MLX vision-language model runner: an mlx-vlm model (llava-style: plain RoPE positions, image
features spliced into the token embeddings at the image's placeholder tokens) on mlx-vlm's own
KV cache, which ``mlx_state`` (with ``mlx_vlm_state``'s adapter) slices and restores per block.

Images are encoded one at a time through the model's public ``get_input_embeddings`` (a prompt
holding only that image's placeholders: its rows are the projected features the model merges),
so a prompt may hold several images even where the model merges one per call. A prefill chunk's
embeddings are the token embeddings with the rows of every image it overlaps replaced: a chunk
may start or end inside an image, and a hit restored up to the middle of one needs only the
rest. Text-only forwards (decode, a chunk past the images) run the language model on ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_vlm.models.cache import make_prompt_cache

from promptcache.core.codec import PayloadCodec
from promptcache.core.hashing import fingerprint_model
from promptcache.engines.block_scheme import BlockScheme
from promptcache.engines.fingerprint import VOLATILE_CONFIG_KEYS, digest_weights
from promptcache.engines.layers import Layout
from promptcache.engines.mlx_codec import MlxCodec
from promptcache.engines.mlx_quant import MlxPacker
from promptcache.engines.mlx_state import (
    crop_positional,
    describe_cache,
    restore_cache,
    slice_positional,
    take_checkpoint,
)
from promptcache.engines.mlx_vlm_state import check_layers


class ImageSpan(NamedTuple):
    """One image in a prompt: its placeholder tokens [start, start + length) and how to get its
    features (``features()`` -> ``(length, hidden)``, from the vision-embedding cache or the
    encoder)."""

    start: int
    length: int
    features: Callable[[], mx.array]


def load_mlx_vlm(path: str | Path, *, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, processor) via ``mlx_vlm.utils.load`` from a local folder; ``dtype`` casts the
    floating weights (float32 by default: the CPU backend's fast path)."""
    from mlx_vlm.utils import load

    model, processor = load(str(path))
    model.set_dtype(getattr(mx, dtype))
    return model, processor


def _config_of(model: Any) -> dict[str, Any]:
    config = getattr(model, "config", None)
    raw = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
    return {k: v for k, v in raw.items() if k not in VOLATILE_CONFIG_KEYS}


class MlxVlmRunner:
    """An mlx-vlm model and its processor (``ModelRunner``'s contract, plus images: ``forward``
    takes each sequence's ``ImageSpan``s and ``encode_image`` runs the vision encoder)."""

    name = "mlx"

    def __init__(self, model: Any, processor: Any, *, block_scheme: BlockScheme | None = None):
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.language = model.language_model
        self.rope_scaling: dict[str, Any] | None = None
        state = self.new_state()
        check_layers(state)
        self.layout: Layout = describe_cache(state)
        self.block_scheme = block_scheme or BlockScheme()
        self.block_scheme.check()
        model_dtype = next(v for _, v in tree_flatten(model.parameters())).dtype
        self.dtype = model_dtype
        self.packer = (
            None if self.block_scheme.is_default else MlxPacker(self.block_scheme, model_dtype)
        )
        self.fingerprint = fingerprint_model(
            _config_of(model),
            digest_weights(
                tree_flatten(model.parameters()), lambda a: np.asarray(a.astype(mx.float32))
            ),
            f"{model_dtype}:kv-full{self.block_scheme.tag}",
            "mlx-vlm",
        )
        text = model.config.text_config
        self.image_token_id = int(model.config.image_token_index)
        eos = getattr(model.config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self.vocab_size = int(text.vocab_size)
        self.model_limit = int(getattr(text, "max_position_embeddings", None) or 2048)
        self.num_encoded = 0  # images through the vision encoder (the vision cache saves these)

    # -- images ---------------------------------------------------------------------------------

    def encode_image(self, pixel_values: Any, num_tokens: int) -> mx.array:
        """One image's projected features ``(num_tokens, hidden)``, evaluated: the encoder and
        projector through the model's public ``get_input_embeddings`` on a prompt holding only
        this image's ``num_tokens`` placeholders. ``pixel_values``: ``(channels, h, w)``."""
        pixels = mx.array(np.asarray(pixel_values))[None]
        ids = mx.array([[self.image_token_id] * num_tokens])
        rows = self.model.get_input_embeddings(ids, pixels).inputs_embeds[0]
        mx.eval(rows)
        self.num_encoded += 1
        return rows

    def _embeddings(self, ids: Sequence[int], start: int, images: Sequence[ImageSpan]) -> Any:
        """Token embeddings of positions [start, start + len(ids)) with image rows spliced in;
        None when no image overlaps them."""
        end = start + len(ids)
        overlapping = [im for im in images if im.start < end and start < im.start + im.length]
        if not overlapping:
            return None
        pieces: list[mx.array] = []
        embed = self.language.model.embed_tokens
        pos = start
        for im in sorted(overlapping, key=lambda im: im.start):
            lo, hi = max(im.start, start), min(im.start + im.length, end)
            if lo > pos:
                pieces.append(embed(mx.array(list(ids[pos - start : lo - start]))))
            pieces.append(im.features()[lo - im.start : hi - im.start])
            pos = hi
        if pos < end:
            pieces.append(embed(mx.array(list(ids[pos - start :]))))
        rows = mx.concatenate(pieces, axis=0)
        return rows.astype(self.dtype)[None]

    # -- the model ------------------------------------------------------------------------------

    def new_state(self) -> list[Any]:
        return make_prompt_cache(self.language)

    def forward(
        self,
        states: Sequence[Any],
        ids: Sequence[Sequence[int]],
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[mx.array]:
        """``ModelRunner.forward``; ``images[i]``: sequence i's image spans (absolute positions:
        each state's offset says where its ids start). One sequence per forward."""
        spans = images or [()] * len(states)
        return [
            self._forward_one(state, list(seq_ids), seq_images)
            for state, seq_ids, seq_images in zip(states, ids, spans, strict=True)
        ]

    def batches_decode(self, states: Sequence[Any]) -> bool:
        return False  # mlx-vlm's batch caches are not wired in: one sequence per forward

    def _forward_one(
        self, state: list[Any], ids: list[int], images: Sequence[ImageSpan]
    ) -> mx.array:
        embeds = self._embeddings(ids, state[0].offset, images)
        tokens = mx.array([ids])
        # the lm head on the last position only: earlier logits are never evaluated (lazy)
        if len(ids) > 1:
            head = None if embeds is None else embeds[:, :-1]
            self.language(tokens[:, :-1], inputs_embeds=head, cache=state)
            mx.eval([c.state for c in state])
        tail = None if embeds is None else embeds[:, -1:]
        logits = self.language(tokens[:, -1:], inputs_embeds=tail, cache=state).logits[0, -1]
        mx.eval(logits, [c.state for c in state])
        return logits

    def slice_block(self, state: list[Any], start: int, end: int) -> Any:
        return slice_positional(state, self.layout, start, end, self.packer)

    def take_checkpoint(self, state: list[Any]) -> Any:
        return take_checkpoint(state, self.layout)

    def restore(self, segments: list[tuple[Any, int]], checkpoint: Any) -> list[Any]:
        return restore_cache(self.new_state(), self.layout, segments, checkpoint, self.packer)

    def crop(self, state: list[Any], length: int) -> None:
        crop_positional(state, self.layout, length)

    def to_numpy(self, logits: mx.array) -> np.ndarray:
        return np.asarray(logits.astype(mx.float32))

    def codec(self) -> PayloadCodec:
        return MlxCodec()
