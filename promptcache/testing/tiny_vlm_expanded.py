"""Tiny random-weight vision-language models whose image tokens are plain causal positions and
whose processor expands an image into more than one token repeated, built offline from
transformers' config classes with the processor their checkpoints name (PIL image processors:
no torchvision): Mistral 3 and Pixtral 12B's LLaVA (Pixtral tower, row breaks and an end token), LLaVA-NeXT and
LLaVA-OneVision (anyres tiles: the count depends on the image's size), Idefics3 (tiles with
row/column markers), Aya Vision and InternVL (tiles), VipLLaVA (several tower layers) and
DeepSeek-VL (a fixed count; the encoder only on the inner model). 2 text layers, hidden 64,
``initializer_range`` 0.2; vision towers of one or two layers on 32-64 pixel tiles.
"""

from __future__ import annotations

from typing import Any

from promptcache.testing.tiny_families import COMMON
from promptcache.testing.tiny_models import train_tiny_tokenizer
from promptcache.testing.tiny_vlm_families import _template

EXPANDED_FAMILIES = ("mistral3", "llava_next", "llava_onevision", "idefics3", "aya_vision",
                     "internvl", "vipllava", "deepseek_vl", "llava_pixtral")  # fmt: skip
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # anyres grids, in multiples of the 32-pixel tile
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             initializer_range=0.2)  # fmt: skip
AYA_TOKENS = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
              "<|IMG_LINE_BREAK|>")  # fmt: skip
IDEFICS_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))  # fmt: skip
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
# family -> (the tokens its processor expands an image into, the model's image token)
TOKENS: dict[str, tuple[tuple[str, ...], str]] = {
    "mistral3": (("[IMG]", "[IMG_BREAK]", "[IMG_END]"), "[IMG]"),
    "llava_pixtral": (("[IMG]", "[IMG_BREAK]", "[IMG_END]"), "[IMG]"),
    "llava_next": (("<image>",), "<image>"),
    "llava_onevision": (("<image>", "<video>"), "<image>"),
    "idefics3": (IDEFICS_TOKENS, "<image>"),
    "aya_vision": (AYA_TOKENS, "<|IMG_PATCH|>"),
    "internvl": (INTERNVL_TOKENS, "<IMG_CONTEXT>"),
    "vipllava": (("<image>",), "<image>"),
    "deepseek_vl": (("<image_placeholder>",), "<image_placeholder>"),
}
PLACEHOLDER = {"internvl": "<IMG_CONTEXT>", "mistral3": "[IMG]", "llava_pixtral": "[IMG]",
               "deepseek_vl": "<image_placeholder>"}  # fmt: skip  # what the template emits


def tiny_expanded_family(name: str, seed: int = 0) -> tuple[Any, Any, Any]:
    """(model, processor, tokenizer) of family ``name`` with random weights, float32; the
    tokenizer's ChatML template places the family's image placeholder. Mistral 3's processor is
    its image processor alone (``PixtralProcessor`` needs torchvision), and so are InternVL's and
    LLaVA-OneVision's (their processors need it for videos): the layouts users without
    torchvision get, the same wherever the tests run."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokens, image_token = TOKENS[name]
    tokenizer = train_tiny_tokenizer(tokens, _template(PLACEHOLDER.get(name, "<image>")))
    image_id = tokenizer.convert_tokens_to_ids(image_token)
    common = {k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}
    text = {**common, "num_hidden_layers": 2, "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    vision, extra = _vision(name)
    if name == "aya_vision":  # Cohere 2: a sliding layer and a full one
        text.update(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    config = AutoConfig.for_model(
        "llava" if name == "llava_pixtral" else name, text_config=text, vision_config=vision, image_token_id=image_id,
        tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    return model, _processor(name, tokenizer), tokenizer


def _vision(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vision config, the outer config's image settings) of a family."""
    if name in ("mistral3", "llava_pixtral"):  # Pixtral 12B: a llava with the tower, no merge
        tower = {
            **TOWER,
            "model_type": "pixtral",
            "image_size": 64,
            "patch_size": 8,
            "head_dim": 16,
        }
        if name == "llava_pixtral":
            return tower, {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
        return tower, {"spatial_merge_size": 2, "vision_feature_layer": -1}
    if name in ("llava_next", "llava_onevision"):
        kind = "clip_vision_model" if name == "llava_next" else "siglip_vision_model"
        select = "default" if name == "llava_next" else "full"
        return {**TOWER, "model_type": kind, "image_size": 32, "patch_size": 8}, {
            "image_grid_pinpoints": PINPOINTS, "vision_feature_select_strategy": select,
            "vision_feature_layer": -1,
            # OneVision: a 2x2 grid is more than 2 tiles' worth and shrinks, a 1x2 one does not
            **({"vision_aspect_ratio": "anyres_max_2"} if name == "llava_onevision" else {}),
        }  # fmt: skip
    if name == "idefics3":
        return {**TOWER, "image_size": 32, "patch_size": 8}, {"scale_factor": 2}
    if name == "aya_vision":
        return {**TOWER, "model_type": "siglip_vision_model", "image_size": 32,
                "patch_size": 8}, {"downsample_factor": 2}  # fmt: skip
    if name == "vipllava":  # the projector reads several tower layers
        return {**TOWER, "model_type": "clip_vision_model", "image_size": 32, "patch_size": 8,
                "projection_dim": 32}, {"vision_feature_layer": [-1, -2]}  # fmt: skip
    if name == "deepseek_vl":
        return {**TOWER, "model_type": "siglip_vision_model", "image_size": 32,
                "patch_size": 8}, {}  # fmt: skip
    return {**TOWER, "image_size": [32, 32], "patch_size": [8, 8]}, {"downsample_ratio": 0.5}


def _processor(name: str, tokenizer: Any) -> Any:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    if name in ("mistral3", "llava_pixtral"):
        from transformers.models.pixtral.image_processing_pil_pixtral import (
            PixtralImageProcessorPil,
        )

        return PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8)
    if name == "llava_next":
        from transformers import LlavaNextProcessor
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )

        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
            image_grid_pinpoints=PINPOINTS,
        )  # fmt: skip
        return LlavaNextProcessor(
            images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=tokenizer.chat_template,
        )  # fmt: skip
    if name == "llava_onevision":  # its image processor alone: its processor needs torchvision
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        return LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
        )
    if name == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        images = Idefics3ImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        )
        return Idefics3Processor(images, tokenizer, image_seq_len=4,
                                 chat_template=tokenizer.chat_template)  # fmt: skip
    if name == "vipllava":
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        images = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return LlavaProcessor(
            images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=tokenizer.chat_template,
        )  # fmt: skip
    if name == "deepseek_vl":
        from transformers import DeepseekVLProcessor, PreTrainedTokenizerFast
        from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import (
            DeepseekVLImageProcessorPil,
        )

        named = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", bos_token="<s>",
            eos_token="<|im_end|>", extra_special_tokens={"image_token": "<image_placeholder>"},
        )  # fmt: skip
        images = DeepseekVLImageProcessorPil(size={"height": 32, "width": 32})
        return DeepseekVLProcessor(images, named, chat_template=tokenizer.chat_template,
                                   num_image_tokens=16)  # fmt: skip
    if name == "aya_vision":
        from transformers import AyaVisionProcessor

        tiles = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                         min_patches=1, max_patches=4)  # fmt: skip
        return AyaVisionProcessor(tiles, tokenizer, patch_size=16, img_size=32,
                                  chat_template=tokenizer.chat_template)  # fmt: skip
    # InternVL: its image processor alone (its processor needs torchvision for videos)
    return GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
