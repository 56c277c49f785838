"""Images for transformers families beyond LLaVA (``VisionModel`` on torch).

- Qwen-VL class (``MROPE``, GLM-4V's included: the same ``get_rope_index`` scheme): image tokens get 3-D RoPE positions from their grid and the text
  after an image is shifted (``torch.mrope``); every forward passes explicit ``position_ids``.
  Qwen3-VL's deepstack features travel with an image's rows (concatenated on the last axis).
- Gemma 3 (``GEMMA``): an image's tokens attend to each other both ways, through the model's
  own ``token_type_ids`` mask input (from the sequence's start, as chunked prefill needs);
  ``whole_images`` keeps an image inside one prefill chunk.

Both feed precomputed encoder rows through the model's public ``mm_encoder_outputs`` argument
with the chunk's ``input_ids``, so the model merges them as it merges its own encoder's output.
Only the image processor is needed (transformers falls back to its PIL one without torchvision).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from promptcache.core.hashing import digest_bytes
from promptcache.core.images import ImageInput
from promptcache.engines.torch.mrope import MropePositions
from promptcache.errors import RequestError
from promptcache.serving.vision import PlaceholderVision, VisionChunk

MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v",
         "glm4v_moe")  # fmt: skip
GEMMA = ("gemma3",)
MAX_GRIDS = 4096  # images whose grid is remembered (a grid is needed on every chunk)


@dataclass
class EncoderRows(BaseModelOutputWithPooling):
    """Precomputed encoder output for ``mm_encoder_outputs`` (a ``ModelOutput``, as the model
    returns it): ``pooler_output`` rows, and Qwen3-VL's ``deepstack_features`` per layer."""

    deepstack_features: list[Any] | None = None


class FamilyVision(PlaceholderVision):
    """What both kinds share: the image processor, the template, the settings key."""

    def __init__(
        self, model: Any, processor: Any, tokenizer: Any, device: Any, dtype: Any, cache_arg: str
    ) -> None:
        self.model = model
        self.device, self.dtype, self.cache_arg = device, dtype, cache_arg
        self.images = getattr(processor, "image_processor", processor)
        self.tokenizer = getattr(processor, "tokenizer", None) or tokenizer
        self.template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        self.hidden = int(model.config.get_text_config().hidden_size)
        settings = {"image_processor": self.images.to_dict(), "kind": type(self).__name__}
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()

    def process(self, image: ImageInput, **kwargs: Any) -> Any:
        try:
            return self.images(images=[image.to_pil()], return_tensors="pt", **kwargs)
        except Exception as exc:  # the client's image (a shape the processor cannot take)
            raise RequestError(f"the image processor refused an image: {exc}") from exc

    def run(self, state: Any, ids: Sequence[int], **kwargs: Any) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        kwargs[self.cache_arg] = state
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[0, -1]


class QwenVision(FamilyVision):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE): placeholder ``image_token_id``
    repeated (t * h * w) / merge^2 times inside the template's vision start/end markers."""

    def __init__(
        self, model: Any, processor: Any, tokenizer: Any, device: Any, dtype: Any, cache_arg: str
    ) -> None:
        super().__init__(model, processor, tokenizer, device, dtype, cache_arg)
        self.image_token_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        self._grids: dict[bytes, tuple[int, int, int]] = {}
        self._lock = threading.Lock()
        self.positions = MropePositions(model, self.grid)

    def _pixels(self, image: ImageInput) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.process(image)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        with self._lock:
            if len(self._grids) >= MAX_GRIDS:
                self._grids.clear()
            self._grids[image.digest] = (t, h, w)
        return out["pixel_values"], (t, h, w)

    def grid(self, image: ImageInput) -> tuple[int, int, int]:
        with self._lock:
            found = self._grids.get(image.digest)
        return found if found is not None else self._pixels(image)[1]

    def num_tokens(self, image: ImageInput) -> int:
        t, h, w = self.grid(image)
        return t * h * w // (self.merge * self.merge)

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        pixels, grid = self._pixels(image)
        out = self.model.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype),
            image_grid_thw=torch.tensor([grid], device=self.device),
            return_dict=True,
        )
        rows = [out.pooler_output[0]]
        rows += [f[0] for f in getattr(out, "deepstack_features", None) or []]  # Qwen3-VL
        return torch.cat(rows, dim=-1).to(self.dtype).contiguous().clone()

    @torch.inference_mode()
    def forward(self, state: Any, chunk: VisionChunk) -> torch.Tensor:
        ids, pieces, start, spans = chunk
        encoded = None
        if pieces:  # the chunk's image rows in prompt order, as the model scatters them
            rows = torch.cat([r for _, r in pieces]).to(self.device, self.dtype)
            main, *deep = rows.split(self.hidden, dim=-1)
            deepstack = [(d,) for d in deep] if deep else None
            encoded = {"image": EncoderRows(pooler_output=(main,), deepstack_features=deepstack)}
        if spans:
            position_ids = self.positions.chunk(state, start, len(ids), spans)
        else:
            position_ids = self.positions.text(state, len(ids))
        return self.run(state, ids, position_ids=position_ids, mm_encoder_outputs=encoded)


class GemmaVision(FamilyVision):
    """Gemma 3: the template's begin-of-image token becomes the processor's full image
    sequence (``\\n\\n<boi>`` + ``mm_tokens_per_image`` soft tokens + ``<eoi>\\n\\n``)."""

    whole_images = True

    def __init__(
        self, model: Any, processor: Any, tokenizer: Any, device: Any, dtype: Any, cache_arg: str
    ) -> None:
        super().__init__(model, processor, tokenizer, device, dtype, cache_arg)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.count = int(cfg.mm_tokens_per_image)
        self.marker = self.tokenizer.convert_ids_to_tokens(int(cfg.boi_token_id))
        soft = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        eoi = self.tokenizer.convert_ids_to_tokens(int(cfg.eoi_token_id))
        built = f"\n\n{self.marker}{soft * self.count}{eoi}\n\n"  # Gemma3Processor's formula
        self.sequence = getattr(processor, "full_image_sequence", None) or built

    def num_tokens(self, image: ImageInput) -> int:
        return self.count

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        pixels = self.process(image, do_pan_and_scan=False)["pixel_values"]
        out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
        rows = out.pooler_output if hasattr(out, "pooler_output") else out
        return rows[0].to(self.dtype).contiguous().clone()

    @torch.inference_mode()
    def forward(self, state: Any, chunk: VisionChunk) -> torch.Tensor:
        ids, pieces, start, spans = chunk
        end = start + len(ids)
        # 1 over image tokens from the sequence's start: the mask reads them by position
        types = torch.zeros((1, end), dtype=torch.long, device=self.device)
        for s in spans:
            types[0, s.start : min(s.end, end)] = 1
        encoded = None
        if pieces:
            rows = torch.cat([r for _, r in pieces]).to(self.device, self.dtype)
            encoded = {"image": EncoderRows(pooler_output=rows[None])}
        return self.run(state, ids, token_type_ids=types, mm_encoder_outputs=encoded)
