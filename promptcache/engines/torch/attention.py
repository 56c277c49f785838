"""Grouped-query attention without copies for prefill chunks after a cache hit (CPU).

transformers' ``sdpa`` attention repeats every key/value head ``num_key_value_groups`` times
(``repeat_kv``: a full copy of the context's keys and values, every layer, every forward)
whenever it passes a mask, i.e. for every prefill chunk that follows cached tokens: on a 135M
model with 3 KV heads for 9 query heads, ~0.5 GB written per forward at 3.6K tokens of context.
torch's SDPA reads grouped heads itself (``enable_gqa``) with the same kernel, and the result is
bitwise the same. ``use_gqa_attention`` registers this as an attention implementation through
transformers' public ``AttentionInterface`` (with sdpa's mask) and switches a model that uses
``sdpa`` to it; anything this path does not cover goes to transformers' own sdpa function.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import AttentionInterface

NAME = "promptcache_sdpa"
UNCOVERED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def gqa_sdpa_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and query.device.type == "cpu"
        and key.shape[-1] == value.shape[-1]
        and not any(kwargs.get(k) for k in UNCOVERED)
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        is_causal=is_causal, **kwargs,
    )  # fmt: skip


def use_gqa_attention(model: Any) -> bool:
    """Switch a text model on ``sdpa`` with grouped KV heads to ``gqa_sdpa_forward`` (in place;
    True when switched). Left alone: other implementations, vision-language models, and models
    whose code branches on the implementation's name (they would miss their sdpa branch)."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not hasattr(model, "set_attn_implementation") or hasattr(config, "vision_config"):
        return False
    text = config.get_text_config()
    heads, kv_heads = (
        getattr(text, k, None) for k in ("num_attention_heads", "num_key_value_heads")
    )
    if not heads or not kv_heads or kv_heads >= heads or _branches_on_name(model):
        return False
    AttentionInterface.register(NAME, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME


def _branches_on_name(model: Any) -> bool:
    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return True  # cannot tell: keep sdpa
    return any(f"_attn_implementation {op}" in source for op in ("==", "!=", "in "))


# cuDNN's attention plans every new shape on the CPU, and a decode step's key length is new every
# token: bfloat16 decode on an H200 went 13.6 -> 46-58 tok/s without it (``gpu_check``)
CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Around a runner's forwards: on CUDA, SDPA may pick any kernel but cuDNN's (torch's
    switches are process-wide: set on entry, restored on exit, so call it from the one thread
    that steps the model); elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(CUDA_SDPA)
