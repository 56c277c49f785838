"""Tiny random-weight M-RoPE checkpoints for mlx-vlm (3-D image positions), built from
transformers' config classes at test time and saved as an mlx-vlm conversion would be.

Families: qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_vl_moe (deepstack), qwen3_5 and qwen3_5_moe
(linear attention + full attention), glm4v and glm4v_moe (GLM's image markers). Each: a 1-2
layer vision tower (hidden 32, 8x8 patches merged 2x2: a 32x48 image is 6 tokens, 64x80 is 20),
a 2-4 layer language model (hidden 64, head 16, 3-D rotary sections that all turn), weights drawn at
``initializer_range`` 0.2 (so greedy replies don't collapse), the ``tiny_models`` BPE tokenizer
with the family's vision tokens, a ChatML template with image parts and the image processor's
``preprocessor_config.json``. ``load_mlx_vlm`` reads the folder back as a user's mlx-community
download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from promptcache.testing.tiny_families import ROUTED_MOE

# (vision start, vision end, image, video) as each family's tokenizer names them
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GLM_TOKENS = ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>")


def tokens_of(family: str) -> tuple[str, ...]:
    return GLM_TOKENS if family.startswith("glm") else VISION_TOKENS


def mrope_template(family: str) -> str:
    """ChatML whose image part is the family's own marker (start, image, end)."""
    start, end, image, _ = tokens_of(family)
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}" + start + image + end +
        "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )  # fmt: skip


TEXT: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                            initializer_range=0.2)  # fmt: skip
QWEN2_ROPE = {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]}
QWEN3_ROPE = {"rope_type": "default", "type": "default", "mrope_section": [2, 3, 3],
              "mrope_interleaved": True, "rope_theta": 10000.0}  # fmt: skip
GLM_ROPE = {"rope_type": "default", "type": "default", "mrope_section": [2, 1, 1],
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5}  # fmt: skip
VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                              patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                              out_hidden_size=64, in_channels=3)  # fmt: skip
GDN: dict[str, Any] = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4,
                           layer_types=["linear_attention", "full_attention"] * 2,
                           full_attention_interval=2, partial_rotary_factor=1.0)  # fmt: skip
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1)  # fmt: skip
GLM_TEXT: dict[str, Any] = dict(num_hidden_layers=2, partial_rotary_factor=0.5,
                                rope_scaling=GLM_ROPE, rope_parameters=GLM_ROPE,
                                attention_bias=True)  # fmt: skip
# family -> (text overrides, vision overrides)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": (
        dict(num_hidden_layers=2, rope_scaling=QWEN2_ROPE, head_dim=None),
        dict(embed_dim=32, hidden_size=64, mlp_ratio=2, depth=1),
    ),
    "qwen2_5_vl": (
        dict(num_hidden_layers=2, rope_scaling=QWEN2_ROPE, head_dim=None),
        dict(window_size=32, fullatt_block_indexes=[1]),
    ),
    "qwen3_vl": (
        dict(num_hidden_layers=2, rope_scaling=QWEN3_ROPE),
        dict(num_position_embeddings=16, deepstack_visual_indexes=[0]),
    ),
    "qwen3_vl_moe": (
        dict(
            num_hidden_layers=2,
            rope_scaling=QWEN3_ROPE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        dict(num_position_embeddings=16, deepstack_visual_indexes=[0]),
    ),  # fmt: skip
    "glm4v": (
        GLM_TEXT,
        dict(image_size=32, window_size=32, rms_norm_eps=1e-5, depth=1),
    ),  # fmt: skip
    "glm4v_moe": (
        dict(
            **GLM_TEXT,
            **ROUTED_MOE,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            use_qk_norm=False,
        ),
        dict(image_size=32, window_size=32, rms_norm_eps=1e-5, depth=1),
    ),  # fmt: skip
    "qwen3_5": (
        dict(num_hidden_layers=4, rope_parameters=QWEN3_ROPE, **GDN),
        dict(num_position_embeddings=16, depth=1),
    ),
    "qwen3_5_moe": (
        dict(num_hidden_layers=4, rope_parameters=QWEN3_ROPE, **GDN, **MOE),
        dict(num_position_embeddings=16, depth=1),
    ),
}
TINY_MROPE_FAMILIES = tuple(FAMILIES)
IMAGE_PROCESSOR = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                       max_pixels=128 * 128, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                       size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128})  # fmt: skip


def tiny_mrope_tokenizer(family: str = "qwen2_vl") -> Any:
    from promptcache.testing.tiny_models import train_tiny_tokenizer

    return train_tiny_tokenizer(tokens_of(family), mrope_template(family))


def mrope_config(family: str, tokenizer: Any) -> dict[str, Any]:
    """The HF config.json of ``family`` (transformers' config class, nested text and vision
    configs as the published checkpoints), special ids from ``tokenizer``."""
    from transformers import AutoConfig

    text_over, vision_over = FAMILIES[family]
    start, end, image, video = (tokenizer.convert_tokens_to_ids(t) for t in tokens_of(family))
    text = {**TEXT, **text_over, "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
    text = {k: v for k, v in text.items() if v is not None}
    vision = {**VISION, **vision_over}
    special = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start,
                   vision_end_token_id=end)  # fmt: skip
    if family.startswith("glm"):  # transformers' names for GLM's image markers
        special.update(image_start_token_id=start, image_end_token_id=end)
    config = AutoConfig.for_model(
        family, text_config=text, vision_config=vision, tie_word_embeddings=False, **special
    ).to_dict()
    # what mlx-vlm reads beside transformers 5's names (older keys it drops), ids at the top too
    for part, over in (("text_config", text), ("vision_config", vision)):
        config[part].update({k: v for k, v in over.items() if k not in config[part]})
    config.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **special,
    )
    config["vision_config"]["model_type"] = family  # as the published checkpoints name it
    if family.startswith("qwen2"):  # the published Qwen2(.5)-VL configs are flat: text at the top
        flat = config.pop("text_config")
        config.update({k: v for k, v in flat.items() if k not in config})
    return config


def build_random_vlm(family: str, config: dict[str, Any], seed: int = 0, std: float = 0.2) -> Any:
    """An mlx-vlm ``Model`` of ``family`` from an HF config dict (sub-configs as mlx-vlm's
    loader reads them), every floating matrix drawn from N(0, std)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import update_module_configs

    from promptcache.engines.mlx.vlm_load import model_package, transformers_as_is

    package = model_package(family)
    config = json.loads(json.dumps(config))  # mlx-vlm's from_dict edits what it reads
    with transformers_as_is():
        model_config = package.ModelConfig.from_dict(config)
        model_config = update_module_configs(model_config, package, config, ["text", "vision"])
    mx.random.seed(seed)
    model = package.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():
        if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating):
            weights[key] = mx.random.normal(value.shape) * std
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    return model


def save_mrope(family: str, folder: str | Path, seed: int = 0) -> Path:
    """``family`` as an mlx-vlm folder: config.json, model.safetensors (MLX layout), tokenizer,
    chat template and image processor settings."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_mrope_tokenizer(family)
    tokenizer.save_pretrained(folder)
    config = mrope_config(family, tokenizer)
    model = build_random_vlm(family, config, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    (folder / "chat_template.jinja").write_text(mrope_template(family))
    return folder
