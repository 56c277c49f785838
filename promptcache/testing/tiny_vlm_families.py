"""Tiny random-weight vision-language models beyond LLaVA, built offline from transformers'
config classes, with the image processor their checkpoints name (PIL backend: no torchvision).

Qwen-VL class (3-D RoPE): qwen2_vl, qwen2_5_vl, qwen3_vl (deepstack features), qwen3_vl_moe,
qwen3_5 (linear attention + full attention), qwen3_5_moe; GLM-4V's glm4v, glm4v_moe. Gemma 3: a SigLIP tower pooled to a
few soft tokens, bidirectional attention among them. Each is 2-4 text layers, hidden 64,
``initializer_range`` 0.2; images of a few dozen pixels a side become 4-30 tokens.
"""

from __future__ import annotations

from typing import Any

from promptcache.testing.tiny_families import COMMON, GDN, HYBRID_LAYERS, MOE, ROUTED_MOE
from promptcache.testing.tiny_models import train_tiny_tokenizer

QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
GLM_TOKENS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>",
              "<|video|>", "<|end_of_video|>")  # fmt: skip
GEMMA_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def _template(image: str) -> str:
    """ChatML whose image content part is ``image`` (what the family's own template emits)."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}" + image + "{% else %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


QWEN_TEMPLATE = _template("<|vision_start|><|image_pad|><|vision_end|>")
GLM_TEMPLATE = _template("<|begin_of_image|><|image|><|end_of_image|>")
GEMMA_TEMPLATE = _template("<start_of_image>")
# head_dim 16: the rotary half (8, or 4 at Qwen3.5's partial rotary 0.5) split over t, h, w
MROPE_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                "mrope_interleaved": True, "partial_rotary_factor": 0.5}  # fmt: skip
V2 = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
          spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
V25 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
           fullatt_block_indexes=[1])  # fmt: skip
V3 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
          patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
          deepstack_visual_indexes=[0])  # fmt: skip
V35 = {k: v for k, v in V3.items() if k != "deepstack_visual_indexes"}
# family -> (text config overrides, vision config, rope parameters)
QWEN_FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": (dict(num_hidden_layers=2), V2, MROPE_ROPE),
    "qwen2_5_vl": (dict(num_hidden_layers=2), V25, MROPE_ROPE),
    "qwen3_vl": (dict(num_hidden_layers=2), V3, {**MROPE_ROPE, "mrope_interleaved": True}),
    "qwen3_vl_moe": (
        dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        V3,
        {**MROPE_ROPE, "mrope_interleaved": True},
    ),
    "qwen3_5": (dict(num_hidden_layers=4, layer_types=HYBRID_LAYERS, **GDN), V35, QWEN3_5_ROPE),
    "qwen3_5_moe": (
        dict(
            num_hidden_layers=4,
            layer_types=HYBRID_LAYERS,
            **GDN,
            **MOE,
            shared_expert_intermediate_size=32,
        ),
        V35,
        QWEN3_5_ROPE,
    ),  # fmt: skip
}
GLM_ROPE = {**MROPE_ROPE, "partial_rotary_factor": 1.0}
GLM_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  image_size=32, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
# GLM-4.1V / 4.5V / 4.6V: the same 3-D RoPE scheme behind its own image markers
GLM_FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "glm4v": (dict(num_hidden_layers=2), GLM_VISION, GLM_ROPE),
    "glm4v_moe": (dict(num_hidden_layers=2, **ROUTED_MOE), GLM_VISION, GLM_ROPE),
}
MROPE_FAMILIES = (*QWEN_FAMILIES, *GLM_FAMILIES)
VISION_FAMILIES = (*MROPE_FAMILIES, "gemma3")


def tiny_vision_family(name: str, seed: int = 0, sliding: bool = True) -> tuple[Any, Any, Any]:
    """(model, image processor, tokenizer) of family ``name`` with random weights, float32.
    ``sliding=False``: Gemma 3 with full attention only (a hit may then end inside an image)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    if name == "gemma3":
        return _tiny_gemma3(seed, sliding)
    if name in GLM_FAMILIES:
        text, vision, rope = GLM_FAMILIES[name]
        tokenizer = train_tiny_tokenizer(GLM_TOKENS, GLM_TEMPLATE)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM_TOKENS}
        markers = dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                       image_start_token_id=ids["<|begin_of_image|>"],
                       image_end_token_id=ids["<|end_of_image|>"],
                       video_start_token_id=ids["<|begin_of_video|>"],
                       video_end_token_id=ids["<|end_of_video|>"])  # fmt: skip
    else:
        text, vision, rope = QWEN_FAMILIES[name]
        tokenizer = train_tiny_tokenizer(QWEN_TOKENS, QWEN_TEMPLATE)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
        markers = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                       vision_start_token_id=ids["<|vision_start|>"],
                       vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    common = {k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}
    text_config = {**common, **text, "vocab_size": len(tokenizer), "rope_parameters": rope,
                   "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    config = AutoConfig.for_model(
        name, text_config=text_config, vision_config={**vision, "initializer_range": 0.2},
        tie_word_embeddings=False, **markers,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    return model, qwen_image_processor(glm=name in GLM_FAMILIES), tokenizer


def qwen_image_processor(glm: bool = False) -> Any:
    """Qwen's (or GLM-4V's) image processor at patch 8, merge 2: a 40x50 image is 48x48 pixels,
    9 tokens."""
    if glm:
        from transformers.models.glm4v.image_processing_pil_glm4v import (
            Glm4vImageProcessorPil as Images,
        )
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Images,
        )
    return Images(
        size={"shortest_edge": 16 * 16, "longest_edge": 96 * 96},
        patch_size=8, merge_size=2, temporal_patch_size=2,
    )  # fmt: skip


def _tiny_gemma3(seed: int, sliding: bool) -> tuple[Any, Any, Any]:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = train_tiny_tokenizer(GEMMA_TOKENS, GEMMA_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_TOKENS}
    common = {k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}
    # 3 layers: the bidirectional image attention of layer 2 reaches the last token's logits
    first = "sliding_attention" if sliding else "full_attention"
    text_config = {**common, "num_hidden_layers": 3, "vocab_size": len(tokenizer),
                   "sliding_window": 24, "layer_types": [first, "full_attention", "full_attention"],
                   "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8)  # fmt: skip
    config = Gemma3Config(
        text_config=text_config, vision_config=vision, mm_tokens_per_image=16,
        image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], tie_word_embeddings=False,
    )  # fmt: skip
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    images = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    return model, images, tokenizer


def save_tiny_vision_family(name: str, folder: str, seed: int = 0) -> str:
    """An HF folder (model, image processor, tokenizer with its chat template) that
    ``promptcache serve --model`` loads as a user's vision-language checkpoint."""
    model, images, tokenizer = tiny_vision_family(name, seed)
    model.save_pretrained(folder)
    images.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_gemma3_processor(folder: str, seed: int = 0) -> str:
    """A Gemma 3 folder whose ``Gemma3Processor`` loads fully (``processor_config.json``, the
    tokenizer's ``boi_token``/``image_token``/``eoi_token``): its image text is the processor's
    ``full_image_sequence``, as in the published checkpoints."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast

    model, images, tokenizer = _tiny_gemma3(seed, sliding=True)
    named = dict(zip(("boi_token", "image_token", "eoi_token"), GEMMA_TOKENS, strict=True))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", bos_token="<s>",
        eos_token="<|im_end|>", extra_special_tokens=named,
    )  # fmt: skip
    processor = Gemma3Processor(images, tokenizer, chat_template=GEMMA_TEMPLATE,
                                image_seq_length=model.config.mm_tokens_per_image)  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
