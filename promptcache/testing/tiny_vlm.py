"""Tiny random-weight vision-language models for tests and benchmarks, built offline from configs.

transformers: LLaVA (a CLIP vision tower, a two-layer projector, a llama text model) with a
locally trained byte-level BPE tokenizer holding an ``<image>`` token, a CLIP image processor and
a ChatML template that places ``<image>`` where a content part is an image. ``size="tiny"`` is
the test model (2 layers, hidden 64, 64 image tokens); ``size="small"`` has an encoder that
costs something on a CPU (benchmarks).
"""

from __future__ import annotations

from typing import Any

from promptcache.testing.tiny_models import train_tiny_tokenizer

IMAGE_TOKEN = "<image>"
# content may be a string or a list of parts ({"type": "text", "text"} / {"type": "image"})
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SIZES: dict[str, dict[str, int]] = {
    # text hidden/layers, vision hidden/layers, image side, patch
    "tiny": dict(hidden=64, layers=2, v_hidden=32, v_layers=2, image=64, patch=8),
    "small": dict(hidden=256, layers=4, v_hidden=384, v_layers=8, image=384, patch=16),
}


def tiny_vlm_tokenizer() -> Any:
    """A byte-level BPE tokenizer with ChatML markers and one ``<image>`` token."""
    return train_tiny_tokenizer((IMAGE_TOKEN,), VLM_TEMPLATE)


def tiny_llava(size: str = "tiny", seed: int = 0) -> tuple[Any, Any]:
    """(LlavaForConditionalGeneration, LlavaProcessor) with random weights."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    s = SIZES[size]
    fast = tiny_vlm_tokenizer()
    image_id = fast.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(fast), hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
        num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, eos_token_id=fast.eos_token_id,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=s["v_hidden"], intermediate_size=2 * s["v_hidden"],
        num_hidden_layers=s["v_layers"], num_attention_heads=4, image_size=s["image"],
        patch_size=s["patch"], projection_dim=s["v_hidden"],
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_id,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )  # fmt: skip
    config.eos_token_id = fast.eos_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    side = s["image"]
    images = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=s["patch"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
        chat_template=VLM_TEMPLATE,
    )
    return model, processor


def save_tiny_llava(folder: str, size: str = "tiny", seed: int = 0) -> str:
    """An HF-format folder (model, tokenizer, processor) that ``promptcache serve --model``
    loads like any vision-language model."""
    model, processor = tiny_llava(size, seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
