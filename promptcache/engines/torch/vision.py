"""The image half of a transformers vision-language model (``VisionModel`` on torch).

Through the model's public methods only: ``get_image_features`` (vision tower + projector) for
an image's rows, ``get_input_embeddings`` for the text, and ``forward(inputs_embeds=...)`` on the
per-request ``DynamicCache``, so restored blocks and chunked prefill work as for text. The
processor is the model's own (``AutoProcessor``): its chat template places the image
placeholder, its image processor prepares pixels, and its token count per image
(``_get_num_multimodal_tokens``, what serving stacks use) expands each placeholder. This is the
LLaVA kind (causal attention, 1-D RoPE: image tokens are plain positions); ``vision_select`` picks
the class for a model, ``vision_families`` has the Qwen-VL (3-D RoPE) and Gemma 3 (bidirectional
image attention) kinds, ``vision_expand`` the causal families whose processor lays an image out
as more than one token repeated (Mistral 3, LLaVA-NeXT anyres, Idefics3, ...).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from promptcache.core.hashing import digest_bytes
from promptcache.core.images import ImageInput
from promptcache.errors import ConfigError, RequestError
from promptcache.serving.vision import PlaceholderVision, VisionChunk

LLAVA = ("llava",)  # model_type values whose image tokens are plain causal positions


class TorchVision(PlaceholderVision):
    """``VisionModel`` for a transformers LLaVA-style model and its processor."""

    def __init__(
        self, model: Any, processor: Any, device: torch.device, dtype: Any, cache_arg: str
    ) -> None:
        kind = getattr(model.config, "model_type", "")
        if kind not in LLAVA or not hasattr(model, "get_image_features"):
            raise ConfigError(f"image input is supported for {', '.join(LLAVA)} here, not {kind!r}")
        self.model = model
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.cache_arg = cache_arg  # "cache" or "past_key_values", as the runner found it
        self.tokenizer = processor.tokenizer
        token = getattr(processor, "image_token", "<image>")
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(token))
        cfg = model.config
        self.feature_layer = cfg.vision_feature_layer
        self.select = cfg.vision_feature_select_strategy
        settings = {
            "image_processor": processor.image_processor.to_dict(),
            "feature_layer": self.feature_layer,
            "select": self.select,
            "patch_size": getattr(processor, "patch_size", None),
        }
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()
        self.template = processor.chat_template or getattr(self.tokenizer, "chat_template", None)

    def num_tokens(self, image: ImageInput) -> int:
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is not None:  # from the size alone: no pixels processed
            data = counter(image_sizes=[(image.height, image.width)])
            return int(data.num_image_tokens[0])
        # else the processor's own expansion of one placeholder (processes the pixels once)
        token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        ids = self.processor(text=[token], images=[image.to_pil()])["input_ids"][0]
        return sum(1 for t in ids if t == self.image_token_id)

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        try:
            pixels = self.processor.image_processor(images=[image.to_pil()], return_tensors="pt")
        except Exception as exc:  # the client's image (a shape the processor cannot take)
            raise RequestError(f"the image processor refused an image: {exc}") from exc
        values = pixels["pixel_values"].to(self.device, self.dtype)
        out = self.model.get_image_features(
            pixel_values=values,
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=self.select,
        )
        rows = out.pooler_output if hasattr(out, "pooler_output") else out
        first = rows[0] if isinstance(rows, list | tuple) else rows[0]
        return first.to(self.dtype).contiguous().clone()

    def forward(self, state: Any, chunk: VisionChunk) -> torch.Tensor:
        return spliced_forward(self.model, self.cache_arg, self.device, state, chunk)


@torch.inference_mode()
def spliced_forward(
    model: Any, cache_arg: str, device: torch.device, state: Any, chunk: VisionChunk
) -> torch.Tensor:
    """A chunk on plain causal positions (LLaVA-style models): its token embeddings with each
    piece's feature rows in place, through the model on ``state``; the last position's logits."""
    x = torch.tensor([list(chunk.ids)], dtype=torch.long, device=device)
    embeds = model.get_input_embeddings()(x)
    for offset, rows in chunk.pieces:
        embeds[0, offset : offset + rows.shape[0]] = rows.to(embeds.dtype)
    out = model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{cache_arg: state})
    return out.logits[0, -1]
