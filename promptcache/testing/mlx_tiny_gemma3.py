"""A tiny random-weight Gemma 3 vision checkpoint for mlx-vlm, built from transformers'
``Gemma3Config`` at test time and saved as an mlx-vlm conversion would be.

A 1-layer SigLIP tower on 64x64 images (8x8 patches) pooled to 16 soft tokens, a 2-layer
language model (hidden 64): a sliding-window layer (window 24, mlx-vlm's ring cache) and a
full-attention one, or (``sliding=False``) two full-attention layers. The ``tiny_models`` BPE
tokenizer carries Gemma's image tokens as named specials (``boi_token``, ``image_token``,
``eoi_token``: what mlx-vlm's ``Gemma3Processor`` reads), ChatML with ``<start_of_image>`` parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from promptcache.testing.mlx_tiny_mrope import build_random_vlm

NAMED = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
         "eoi_token": "<end_of_image>"}  # fmt: skip
GEMMA3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SOFT_TOKENS, WINDOW = 16, 24


def tiny_gemma3_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    from promptcache.testing.tiny_models import train_tiny_tokenizer

    trained = train_tiny_tokenizer(tuple(NAMED.values()), GEMMA3_TEMPLATE)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer, pad_token="<pad>", bos_token="<s>",
        eos_token="<|im_end|>", extra_special_tokens=NAMED,
    )  # fmt: skip
    fast.chat_template = GEMMA3_TEMPLATE
    return fast


def gemma3_config(tokenizer: Any, sliding: bool = True) -> dict[str, Any]:
    """The HF config.json (``Gemma3Config``), plus the keys mlx-vlm's gemma3 reads beside
    transformers 5's names (layer pattern, RoPE bases, soft tokens in the text config)."""
    from transformers import Gemma3Config

    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in NAMED.items()}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                max_position_embeddings=4096, vocab_size=len(tokenizer), sliding_window=WINDOW,
                layer_types=["sliding_attention" if sliding else "full_attention",
                             "full_attention"],
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, initializer_range=0.2)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8)  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=SOFT_TOKENS,
        image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], tie_word_embeddings=False,
    ).to_dict()  # fmt: skip
    config["text_config"].update(
        sliding_window_pattern=2 if sliding else 1, mm_tokens_per_image=SOFT_TOKENS,
        rope_local_base_freq=10000.0, rope_global_base_freq=1000000.0,
    )  # fmt: skip
    config.update(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, hidden_size=64)  # fmt: skip
    return config


def save_gemma3(folder: str | Path, seed: int = 0, sliding: bool = True) -> Path:
    """The tiny Gemma 3 as an mlx-vlm folder: config.json, model.safetensors (MLX layout),
    tokenizer, chat template, image processor and processor settings."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_gemma3_tokenizer()
    tokenizer.save_pretrained(folder)
    config = gemma3_config(tokenizer, sliding)
    # Gemma scales its embeddings by sqrt(hidden): N(0, 0.1) keeps greedy replies as varied as
    # 0.2 does for the other families (0.2 collapses the all-full-attention variant)
    model = build_random_vlm("gemma3", config, seed, std=0.1)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": SOFT_TOKENS}))
    (folder / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    return folder
