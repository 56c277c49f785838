"""Which ``VisionModel`` a torch model gets, by its config: the LLaVA kind (``vision``), the
expanded-layout causal families (``vision_expand``), Qwen-VL's 3-D RoPE and Gemma 3's
bidirectional image attention (``vision_families``)."""

from __future__ import annotations

from typing import Any

import torch

from promptcache.engines.torch.vision import LLAVA, TorchVision
from promptcache.engines.torch.vision_expand import EXPANDED, ExpandedVision, is_expanded
from promptcache.engines.torch.vision_families import GEMMA, MROPE, GemmaVision, QwenVision


def image_families() -> dict[str, str]:
    """model_type -> how its images are placed, for every family with images on torch."""
    out = dict.fromkeys(LLAVA, "causal positions")
    layout = "causal positions, the processor's image layout"
    out.update({k: layout for k in EXPANDED if k != "pixtral"})  # pixtral: a kind of llava
    out.update(dict.fromkeys(MROPE, "3-D RoPE positions"))
    out.update(dict.fromkeys(GEMMA, "bidirectional image attention"))
    return out


def make_vision(
    model: Any, processor: Any, tokenizer: Any, device: torch.device, dtype: Any, cache_arg: str
) -> Any:
    """The ``VisionModel`` for ``model``: ``processor`` is its ``AutoProcessor`` or, where that
    cannot load (a video processor needing torchvision), its image processor alone."""
    kind = getattr(model.config, "model_type", "")
    if is_expanded(model.config):
        return ExpandedVision(model, processor, tokenizer, device, dtype, cache_arg)
    if kind in MROPE:
        return QwenVision(model, processor, tokenizer, device, dtype, cache_arg)
    if kind in GEMMA:
        return GemmaVision(model, processor, tokenizer, device, dtype, cache_arg)
    return TorchVision(model, processor, device, dtype, cache_arg)
