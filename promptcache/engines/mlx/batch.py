"""Batched decode on mlx-lm: one forward for many requests' next tokens, through mlx-lm's own
batch caches.

Each request keeps its own cache list (the prompt cache slices, checkpoints and restores per
request). A decode step merges layer j of every request with that class's public ``merge``
(``KVCache`` -> ``BatchKVCache``, left-padded with per-row offsets; ``RotatingKVCache`` ->
``BatchRotatingKVCache``; ``ArraysCache`` stacks SSM/conv state; ``CacheList`` merges slot by
slot), runs the model once on a ``[B, 1]`` batch, and gives every request back its row with
``extract``. mlx-lm's models take per-row offsets from these caches (RoPE and masks), as its own
``BatchGenerator`` does.

A quantized KV cache (``QuantizedKVCache``) has no batched form in mlx-lm: with ``kv_bits`` the
model decodes one sequence per forward (same results, no batching gain).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

BATCHED_KINDS = (KVCache, RotatingKVCache, ArraysCache, CacheList)


def can_batch(state: list[Any]) -> bool:
    """True when every layer's cache class (and every slot of a ``CacheList``) merges."""

    def ok(c: Any) -> bool:
        if type(c) is CacheList:
            return all(ok(x) for x in c.caches)
        return type(c) in BATCHED_KINDS

    return all(ok(c) for c in state)


def batched_decode(
    model: Any, states: Sequence[list[Any]], tokens: Sequence[int]
) -> list[mx.array]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward; each row's logits."""
    batch = [type(layer).merge([s[j] for s in states]) for j, layer in enumerate(states[0])]
    logits = model(mx.array([[t] for t in tokens]), cache=batch)[:, -1]
    for i, state in enumerate(states):
        for j, layer in enumerate(batch):
            state[j] = layer.extract(i)
    mx.eval(logits, [c.state for s in states for c in s])
    return [logits[i] for i in range(len(states))]
