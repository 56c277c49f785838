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

from promptcache.engines.errors import ConfigError
from promptcache.engines.mlx.state import LAYERS, SNAPSHOT, MlxLayer


@dataclass(frozen=True, slots=True)
class VlmKVLayer(MlxLayer):
    """mlx-vlm's ``KVCache``: positional, 2 arrays; restored through its 2-tuple ``state``."""

    def set_arrays(self, c: Any, arrays: list[mx.array], num_tokens: int) -> None:
        # its setter takes the offset from the keys: restored arrays are exactly num_tokens long
        if arrays[0].shape[-2] != num_tokens:
            raise ValueError(f"restored keys cover {arrays[0].shape[-2]} tokens, not {num_tokens}")
        c.state = (arrays[0], arrays[1])


LAYERS.register(VlmKVCache, VlmKVLayer(num_arrays=2))
LAYERS.register(VlmArraysCache, SNAPSHOT)
KNOWN = (VlmKVCache, VlmArraysCache)


def check_layers(cache: list[Any]) -> None:
    """ConfigError unless every layer is mlx-vlm's plain ``KVCache`` or ``ArraysCache`` (the
    kinds this engine can slice, checkpoint and restore; rings and the rest have no adapter)."""
    kinds = sorted({type(c).__name__ for c in cache if type(c) not in KNOWN})
    if kinds:
        raise ConfigError(
            "the mlx-vlm engine supports language models with a plain KV cache or "
            f"linear-attention state; this one uses {', '.join(kinds)}"
        )
