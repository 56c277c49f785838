"""Payload <-> flat arrays + a JSON structure, so any tier can write a payload as safetensors.

A payload is a tree of dicts, lists, tuples and leaves. Array leaves become named numpy arrays;
other leaves are JSON scalars or, via ``encode_leaf``/``decode_leaf``, engine types (a torch
device, a dtype). Engines subclass ``TreeCodec`` for their array type; ``TreeCodec`` itself
handles numpy.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np


class PayloadCodec(Protocol):
    def to_arrays(self, payload: Any, checkpoint: Any) -> tuple[dict[str, np.ndarray], str]:
        """Arrays by name and a JSON string describing how to rebuild both objects."""

    def from_arrays(self, arrays: dict[str, np.ndarray], structure: str) -> tuple[Any, Any]:
        """Inverse of ``to_arrays``: (payload, checkpoint)."""


class TreeCodec:
    """Numpy arrays and JSON scalars in nested dicts/lists/tuples."""

    def encode_leaf(self, value: Any, arrays: dict[str, np.ndarray]) -> Any:
        if isinstance(value, np.ndarray):
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(value)
            return {"t": "np", "k": name}
        if value is None or isinstance(value, bool | int | float | str):
            return {"t": "py", "v": value}
        raise TypeError(f"cannot store a {type(value).__name__} in a cache file")

    def decode_leaf(self, node: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        if node["t"] == "np":
            return arrays[node["k"]]
        if node["t"] == "py":
            return node["v"]
        raise ValueError(f"unknown leaf type {node['t']!r} in a cache file")

    def _encode(self, value: Any, arrays: dict[str, np.ndarray]) -> Any:
        if isinstance(value, dict):
            return {"t": "dict", "items": [[k, self._encode(v, arrays)] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {"t": type(value).__name__, "items": [self._encode(v, arrays) for v in value]}
        return self.encode_leaf(value, arrays)

    def _decode(self, node: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        kind = node["t"]
        if kind == "dict":
            return {k: self._decode(v, arrays) for k, v in node["items"]}
        if kind in ("list", "tuple"):
            items = [self._decode(v, arrays) for v in node["items"]]
            return items if kind == "list" else tuple(items)
        return self.decode_leaf(node, arrays)

    def to_arrays(self, payload: Any, checkpoint: Any) -> tuple[dict[str, np.ndarray], str]:
        arrays: dict[str, np.ndarray] = {}
        tree = [self._encode(payload, arrays), self._encode(checkpoint, arrays)]
        return arrays, json.dumps(tree)

    def from_arrays(self, arrays: dict[str, np.ndarray], structure: str) -> tuple[Any, Any]:
        payload, checkpoint = json.loads(structure)
        return self._decode(payload, arrays), self._decode(checkpoint, arrays)
