"""A tiny random-weight vision-language model on mlx-vlm, built from a config, for tests and demos.

Llava: a 2-layer CLIP vision tower (hidden 32, 32x32 images in 8x8 patches: 16 image tokens per
image), a projector, and a 2-layer llama language model (hidden 64) with plain RoPE positions, so
its KV cache is positional like mlx-lm's; ``size="small"`` is the transformers side's small
LLaVA (an encoder that costs something on a CPU: benchmarks). The tokenizer and chat template are
the transformers tiny LLaVA's (``tiny_vlm``): a byte-level BPE with one ``<image>`` token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from promptcache.testing.tiny_vlm import IMAGE_TOKEN, SIZES, VLM_TEMPLATE, tiny_vlm_tokenizer

# "tiny" (tests): 32x32 images, 16 tokens each; "small" (benchmarks): transformers' small LLaVA
MLX_SIZES = {"tiny": dict(SIZES["tiny"], image=32), "small": SIZES["small"]}


def tiny_vlm_config(vocab_size: int, image_token_index: int, size: str = "tiny") -> dict[str, Any]:
    s = MLX_SIZES[size]
    text = dict(model_type="llama", hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                intermediate_size=2 * s["hidden"], num_attention_heads=4, num_key_value_heads=2,
                vocab_size=vocab_size, rms_norm_eps=1e-5, max_position_embeddings=8192)  # fmt: skip
    vision = dict(model_type="clip_vision_model", num_hidden_layers=s["v_layers"],
                  hidden_size=s["v_hidden"], intermediate_size=2 * s["v_hidden"],
                  num_attention_heads=4 if s["v_hidden"] > 32 else 2, image_size=s["image"],
                  patch_size=s["patch"], projection_dim=s["v_hidden"])  # fmt: skip
    return dict(model_type="llava", image_token_index=image_token_index, vocab_size=vocab_size,
                vision_feature_layer=-2, vision_feature_select_strategy="default",
                text_config=text, vision_config=vision)  # fmt: skip


def build_llava(config: dict[str, Any], seed: int = 0) -> Any:
    """An mlx-vlm llava ``Model`` from a config dict (sub-configs as mlx-vlm's loader makes them),
    random weights from ``seed``."""
    import mlx.core as mx

    from promptcache.engines.mlx.vlm_load import model_package

    llava = model_package("llava")
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = llava.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = llava.Model(model_config)
    mx.eval(model.parameters())
    return model


def tiny_vlm_processor(folder: str | None = None, size: str = "tiny") -> Any:
    """mlx-vlm's ``LlavaProcessor`` over a CLIP image processor (no torchvision) and the tiny
    tokenizer (also saved to ``folder`` when given)."""
    from promptcache.engines.mlx.vlm_load import processor_class

    try:  # transformers 5: the PIL/numpy backend (the default one needs torchvision)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    fast = tiny_vlm_tokenizer()
    if folder is not None:
        fast.save_pretrained(folder)
    side, patch = MLX_SIZES[size]["image"], MLX_SIZES[size]["patch"]
    images = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    # the CLS token is counted (+1) then dropped by the "default" feature selection (-1)
    return processor_class("llava")(
        image_processor=images,
        tokenizer=fast,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VLM_TEMPLATE,
    )


def mlx_tiny_vlm(seed: int = 0, size: str = "tiny") -> tuple[Any, Any]:
    """(model, processor): the tiny llava and its processor, vocabulary sizes matched."""
    processor = tiny_vlm_processor(size=size)
    tok = processor.tokenizer
    config = tiny_vlm_config(len(tok), tok.convert_tokens_to_ids(IMAGE_TOKEN), size)
    config["eos_token_id"] = tok.eos_token_id
    return build_llava(config, seed), processor


def save_mlx_tiny_vlm(folder: str, seed: int = 0) -> str:
    """Write the tiny llava (weights in MLX layout, config.json, tokenizer, processor config) to
    ``folder``: what ``load_mlx_vlm`` reads back."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    processor = tiny_vlm_processor(folder)
    tok = processor.tokenizer
    config = tiny_vlm_config(len(tok), tok.convert_tokens_to_ids(IMAGE_TOKEN))
    config["eos_token_id"] = tok.eos_token_id
    model = build_llava(config, seed)
    path = Path(folder)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    processor.image_processor.save_pretrained(folder)
    processor_config = dict(patch_size=MLX_SIZES["tiny"]["patch"], vision_feature_select_strategy="default",
                            image_token=IMAGE_TOKEN, num_additional_image_tokens=1)  # fmt: skip
    (path / "processor_config.json").write_text(json.dumps(processor_config, indent=2))
    (path / "chat_template.jinja").write_text(VLM_TEMPLATE)
    return folder
