"""Batched decode on transformers: one forward for many requests' next tokens.

Each request keeps its own ``DynamicCache`` (the prompt cache slices, checkpoints and restores
per request). A decode step gathers them into one left-padded batch: every layer's keys/values
are copied right-aligned into a ``[B, heads, L, dim]`` tensor (L the longest sequence), a 2-D
``attention_mask`` hides the padding, and ``position_ids`` give each row its own position (RoPE
must not see the padding). After the forward each request's layer takes back a *view* of its row
(the padding cut off): no copy back, and transformers' next ``torch.cat`` makes it contiguous.

Only layouts whose every layer is a plain ``DynamicLayer`` batch: a sliding-window ring
(gemma3) holds a different length per layer and a linear-attention/SSM layer (mamba, jamba,
bamba) carries convolution state that transformers' masks do not describe; those models decode
one sequence per forward (same results, no batching gain). Only the public cache API is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from promptcache.engines.layers import Layout


def can_batch(layout: Layout) -> bool:
    """True when every layer is full attention (keys/values only): padding + mask is exact."""
    return not layout.snapshot and all(k == DynamicLayer.__name__ for k in layout.kinds)


def batched_decode(
    model: Any, cache_arg: str, states: Sequence[DynamicCache], tokens: Sequence[int]
) -> list[torch.Tensor]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward; each row's logits."""
    lengths = [s.get_seq_length() for s in states]
    longest, rows = max(lengths), len(states)
    device = states[0].layers[0].keys.device
    batch = DynamicCache(config=model.config)
    for j, layer in enumerate(batch.layers):
        parts = [s.layers[j] for s in states]
        k0, v0 = parts[0].keys, parts[0].values
        keys = k0.new_zeros((rows, k0.shape[1], longest, k0.shape[3]))
        values = v0.new_zeros((rows, v0.shape[1], longest, v0.shape[3]))
        for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
            keys[i, :, longest - n :] = part.keys[0]
            values[i, :, longest - n :] = part.values[0]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    # the mask covers the cached positions and the new one; padding is the left part of a row
    mask = torch.zeros((rows, longest + 1), dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, longest - n :] = 1
    out = model(
        input_ids=torch.tensor([[t] for t in tokens], dtype=torch.long, device=device),
        attention_mask=mask,
        position_ids=torch.tensor([[n] for n in lengths], dtype=torch.long, device=device),
        use_cache=True,
        logits_to_keep=1,
        **{cache_arg: batch},
    )
    for i, (state, n) in enumerate(zip(states, lengths, strict=True)):
        start = longest - n  # the row's first real position; the new token is the last
        for j, layer in enumerate(batch.layers):
            state.layers[j].keys = layer.keys[i : i + 1, :, start:]
            state.layers[j].values = layer.values[i : i + 1, :, start:]
    return [out.logits[i, -1] for i in range(rows)]
