"""What identifies a model's weights for cache keys: config (minus volatile keys) + a digest."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from promptcache.core.hashing import digest_bytes

# config keys that change between saves of the same weights; left out of the model fingerprint
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "_commit_hash",
    }
)


def digest_weights(named: Iterable[tuple[str, Any]], to_numpy: Callable[[Any], np.ndarray]) -> str:
    """Digest of every parameter's name, shape, dtype and a strided sample of 256 of its values
    (``to_numpy`` converts the sample only, never a whole array)."""
    parts = []
    for name, arr in sorted(named, key=lambda item: item[0]):
        flat = arr.reshape(-1)
        sample = flat[:: max(1, math.prod(arr.shape) // 256)][:256]
        data = to_numpy(sample).astype(np.float32).tobytes()
        parts.append(f"{name}:{tuple(arr.shape)}:{arr.dtype}".encode() + digest_bytes(data))
    return digest_bytes(b"|".join(parts)).hex()
