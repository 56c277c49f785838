"""mlx-vlm's own cache classes in ``mlx_state``'s adapter registry.

mlx-vlm's language models keep their KV cache in ``mlx_vlm.models.cache.KVCache``, not mlx-lm's
class: same growing key/value buffers (sequence on axis -2, ``offset`` tokens used, ``trim``), but
its ``state`` is ``(keys, values)`` with the offset taken from the keys' length. Registering its
adapter here (imported only with mlx-vlm) keeps ``mlx_state`` free of mlx-vlm. Its ``ArraysCache``
(Qwen3.5's linear-attention conv/SSM state: ``state`` is the list of arrays) is snapshot state,
checkpointed whole; every other mlx-vlm cache kind is refused by ``check_layers`` rather than
checkpointed by a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache as VlmArraysCache
from mlx_vlm.models.cache import KVCache as VlmKVCache
from mlx_vlm.models.cache import RotatingKVCache as VlmRotatingKVCache

from promptcache.engines.mlx.state import LAYERS, SNAPSHOT, MlxLayer
from promptcache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class VlmKVLayer(MlxLayer):
    """mlx-vlm's ``KVCache``: positional, 2 arrays; restored through its 2-tuple ``state``."""

    def set_arrays(self, c: Any, arrays: list[mx.array], num_tokens: int) -> None:
        # its setter takes the offset from the keys: restored arrays are exactly num_tokens long
        if arrays[0].shape[-2] != num_tokens:
            raise ValueError(f"restored keys cover {arrays[0].shape[-2]} tokens, not {num_tokens}")
        c.state = (arrays[0], arrays[1])


LAYERS.register(VlmKVCache, VlmKVLayer(num_arrays=2))


@dataclass(frozen=True, slots=True)
class VlmRingLayer(MlxLayer):
    """mlx-vlm's ``RotatingKVCache`` (a sliding window's ring): snapshot state, its whole
    buffers plus the ring's public ``meta_state`` (its ``state`` alone drops the offsets)."""

    def checkpoint(self, c: Any) -> Any:
        meta = tuple(int(x) for x in c.meta_state)  # keep, max_size, offset, write index
        return (mx.array(c.keys), mx.array(c.values), meta)

    def restore_checkpoint(self, c: Any, state: Any) -> None:
        keys, values, meta = state
        c.keys, c.values = mx.array(keys), mx.array(values)
        c.meta_state = tuple(str(int(x)) for x in meta)


LAYERS.register(VlmArraysCache, SNAPSHOT)
LAYERS.register(VlmRotatingKVCache, VlmRingLayer())
KNOWN = (VlmKVCache, VlmArraysCache, VlmRotatingKVCache)


def check_layers(cache: list[Any]) -> None:
    """ConfigError unless every layer is mlx-vlm's ``KVCache``, ``ArraysCache`` or
    ``RotatingKVCache`` (the kinds this engine can slice, checkpoint and restore)."""
    kinds = sorted({type(c).__name__ for c in cache if type(c) not in KNOWN})
    if kinds:
        raise ConfigError(
            "the mlx-vlm engine supports language models with KV caches, sliding-window "
            f"rings or linear-attention state; this one uses {', '.join(kinds)}"
        )
