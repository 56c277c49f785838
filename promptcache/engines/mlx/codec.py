"""MLX payloads <-> numpy for block files (standard safetensors, readable with ``mx.load``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from promptcache.core.codec import TreeCodec

# numpy has no bfloat16: such arrays travel as their raw 16-bit patterns
_VIEW_AS = {mx.bfloat16: mx.uint16}


class MlxCodec(TreeCodec):
    def encode_leaf(self, value: Any, arrays: dict[str, np.ndarray]) -> Any:
        if isinstance(value, mx.array):
            view = _VIEW_AS.get(value.dtype)
            name = f"a{len(arrays)}"
            arrays[name] = np.asarray(value.view(view) if view is not None else value)
            return {"t": "mlx", "k": name, "dtype": str(value.dtype).removeprefix("mlx.core.")}
        return super().encode_leaf(value, arrays)

    def decode_leaf(self, node: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        if node["t"] == "mlx":
            arr = mx.array(arrays[node["k"]])
            dtype = getattr(mx, node["dtype"])
            return arr.view(dtype) if dtype in _VIEW_AS else arr
        return super().decode_leaf(node, arrays)
