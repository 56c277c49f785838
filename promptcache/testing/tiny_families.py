"""Tiny random-weight checkpoints of every architecture family we claim, built from the
library's own config class (transformers) at test time, saved as HF folders both engines load
(torch through transformers, mlx through ``mlx_lm.load``, which converts HF weights itself).

Each is 2-4 layers, hidden 64, ``initializer_range`` 0.2 (so greedy replies don't collapse to one
repeated token), with ``tiny_models``' trained BPE tokenizer. ``-vl`` families are the real
checkpoint layout of a vision-language model: ``text_config`` + ``vision_config``, the decoder's
weights under ``model.language_model.*``, a tiny vision tower beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                              initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek-style routed experts (glm4_moe shares them): a shared expert, one dense layer first
ROUTED_MOE: dict[str, Any] = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                  topk_group=1)  # fmt: skip
GDN: dict[str, Any] = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
QWEN_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                   patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                                   out_hidden_size=64, num_position_embeddings=16)  # fmt: skip
SIGLIP: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
MAMBA2: dict[str, Any] = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
                              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)  # fmt: skip


class Family(NamedTuple):
    model_type: str  # transformers' config model type (the text config of a ``-vl`` family)
    text: dict[str, Any]  # overrides of COMMON (a key set to None is dropped)
    # keys the published checkpoints' config.json carry beside what transformers 5 writes (older
    # names mlx-lm reads); written into the text config as they are
    hub: dict[str, Any] | None = None
    vision: dict[str, Any] | None = None  # a ``-vl`` family: its vision tower's config
    outer_type: str | None = None  # a ``-vl`` family: the whole model's model type


GDN_HUB = {"full_attention_interval": 4}  # the layer pattern as mlx-lm reads it
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", dict(num_hidden_layers=2)),
    "qwen3": Family("qwen3", dict(num_hidden_layers=2)),
    "qwen3_moe": Family("qwen3_moe", dict(num_hidden_layers=2, **MOE, decoder_sparse_step=1)),
    "qwen3_next": Family(
        "qwen3_next",
        dict(
            num_hidden_layers=4,
            layer_types=HYBRID_LAYERS,
            **GDN,
            **MOE,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
        ),
        GDN_HUB,
    ),  # fmt: skip
    "qwen3_5": Family(
        "qwen3_5_text", dict(num_hidden_layers=4, layer_types=HYBRID_LAYERS, **GDN), GDN_HUB
    ),
    "qwen3_5_moe": Family(
        "qwen3_5_moe_text",
        dict(
            num_hidden_layers=4,
            layer_types=HYBRID_LAYERS,
            **GDN,
            **MOE,
            shared_expert_intermediate_size=32,
            intermediate_size=None,
        ),
        GDN_HUB,
    ),  # fmt: skip
    "gpt_oss": Family(  # attention sinks, sliding + full attention, MoE with biases
        "gpt_oss",
        dict(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),  # fmt: skip
    "gemma3": Family(
        "gemma3_text",
        dict(
            num_hidden_layers=2,
            sliding_window=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        {"sliding_window_pattern": 2},
    ),  # fmt: skip
    "deepseek_v3": Family(  # multi-head latent attention (MLA), one dense layer then MoE
        "deepseek_v3",
        dict(
            num_hidden_layers=2,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=None,
            num_key_value_heads=4,
            **ROUTED_MOE,
        ),
    ),  # fmt: skip
    "glm4_moe": Family(
        "glm4_moe",
        dict(
            num_hidden_layers=2,
            **ROUTED_MOE,
            partial_rotary_factor=0.5,
        ),
    ),  # fmt: skip
    "nemotron_h": Family(  # Mamba2, attention and MLP blocks
        "nemotron_h",
        dict(
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
        ),
    ),  # fmt: skip
    "lfm2": Family(  # short convolutions and attention
        "lfm2",
        dict(
            num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=True,  # as published: mlx-lm's lfm2 has no separate lm_head
        ),
        dict(
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            full_attn_idxs=[1],
        ),
    ),  # fmt: skip
    "granitemoehybrid": Family(  # Mamba2 + attention, MoE
        "granitemoehybrid",
        dict(
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            **MAMBA2,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
        ),
        {"layer_types": ["mamba", "attention"]},
    ),  # fmt: skip
    "falcon_h1": Family(  # Mamba2 and attention side by side in every layer
        "falcon_h1",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=128,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        ),
    ),  # fmt: skip
    "mamba2": Family(
        "mamba2",
        dict(
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            state_size=8,
            expand=2,
            n_groups=1,
            conv_kernel=4,
            chunk_size=16,
            num_attention_heads=None,
            num_key_value_heads=None,
            intermediate_size=None,
        ),
        {"intermediate_size": 128},
    ),  # fmt: skip
}
for _name, _outer, _vision in (
    ("qwen3_5", "qwen3_5", QWEN_VISION),
    ("qwen3_5_moe", "qwen3_5_moe", QWEN_VISION),
    ("gemma3", "gemma3", SIGLIP),
):
    FAMILIES[f"{_name}-vl"] = FAMILIES[_name]._replace(vision=_vision, outer_type=_outer)
FAMILY_NAMES = tuple(FAMILIES)


def family_config(name: str, vocab_size: int = 320, **special_ids: int) -> Any:
    """The transformers config of family ``name`` (the whole model's for a ``-vl`` family)."""
    from transformers import AutoConfig

    family = FAMILIES[name]
    text = {**COMMON, **family.text, "vocab_size": vocab_size, **special_ids}
    text = {k: v for k, v in text.items() if v is not None}
    text_config = AutoConfig.for_model(family.model_type, **text)
    if family.outer_type is None:
        return text_config
    vision = dict(family.vision or {})
    outer: dict[str, Any] = {}
    if family.outer_type == "gemma3":
        vision["model_type"] = "siglip_vision_model"
        outer = dict(mm_tokens_per_image=4, image_token_index=vocab_size - 1)
    else:
        outer = dict(image_token_id=vocab_size - 1, video_token_id=vocab_size - 2,
                     vision_start_token_id=vocab_size - 3, vision_end_token_id=vocab_size - 4)  # fmt: skip
    return AutoConfig.for_model(
        family.outer_type, text_config=text_config.to_dict(), vision_config=vision,
        tie_word_embeddings=False, **outer,
    )  # fmt: skip


def build_family(name: str, seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer): family ``name`` with random weights, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from promptcache.testing.tiny_models import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer()
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    config = family_config(name, len(tokenizer), **ids)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if FAMILIES[name].outer_type else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    return model, tokenizer


def save_family(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Family ``name`` as an HF folder (config, safetensors, tokenizer) that ``promptcache serve
    --model`` loads on either engine, as a user's downloaded checkpoint."""
    model, tokenizer = build_family(name, seed)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    family = FAMILIES[name]
    config = json.loads((folder / "config.json").read_text())
    if family.outer_type is None:
        config.update(family.hub or {})
    else:  # and the vocabulary at the top, as mlx-lm's multimodal args read it
        config["text_config"].update(family.hub or {})
        config["vocab_size"] = config["text_config"]["vocab_size"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def save_mlx_family(name: str, folder: str | Path, seed: int = 0, bits: int | None = None) -> Path:
    """Family ``name`` as an MLX conversion (an mlx-community-style folder): the same config and
    tokenizer as ``save_family``, random weights in mlx-lm's own layout from its model class (a
    ``-vl`` family keeps a vision-tower tensor beside them, which mlx-lm drops). ``bits``: a
    quantized conversion (groups of 32, bfloat16 scales, as ``mlx_lm.convert -q`` writes)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    from promptcache.engines.mlx.config import mlx_model_config

    folder = save_family(name, folder, seed)
    raw = json.loads((folder / "config.json").read_text())
    config = {**raw, **mlx_model_config(raw)}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():  # matrices at initializer_range, as transformers inits
        if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating):
            weights[key] = mx.random.normal(value.shape) * COMMON["initializer_range"]
    if bits is not None:
        model.update(tree_unflatten(list(weights.items())))
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=32, bits=bits, class_predicate=_quantizable)
        weights = dict(tree_flatten(model.parameters()))
        raw["quantization"] = {"group_size": 32, "bits": bits}
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
    if FAMILIES[name].outer_type is not None:
        weights["vision_tower.patch_embed.proj.weight"] = mx.zeros((32, 3, 8, 8))
    for old in folder.glob("model*.safetensors"):
        old.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


def _quantizable(path: str, module: Any) -> bool:
    weight = getattr(module, "weight", None)
    return hasattr(module, "to_quantized") and weight is not None and weight.shape[-1] % 32 == 0
