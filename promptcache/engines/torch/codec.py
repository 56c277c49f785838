"""Torch payloads (tensors, devices, dtypes in nested containers) <-> numpy for block files."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from promptcache.core.codec import TreeCodec

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# numpy has no bfloat16: such tensors travel as their raw 16-bit patterns
_VIEW_AS = {torch.bfloat16: torch.int16}


class TorchCodec(TreeCodec):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def encode_leaf(self, value: Any, arrays: dict[str, np.ndarray]) -> Any:
        if torch.is_tensor(value):
            t = value.detach().contiguous().cpu()
            view = _VIEW_AS.get(t.dtype)
            name = f"a{len(arrays)}"
            arrays[name] = (t.view(view) if view is not None else t).numpy()
            return {"t": "torch", "k": name, "dtype": str(t.dtype).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        return super().encode_leaf(value, arrays)

    def decode_leaf(self, node: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        kind = node["t"]
        if kind == "torch":
            arr = arrays[node["k"]]
            # a read-only view (a shared-tier value: bytes this read alone owns) is shared too:
            # payloads are immutable, so copying it would only cost time
            t = torch.from_numpy(arr)
            dtype = getattr(torch, node["dtype"])
            if dtype in _VIEW_AS:
                t = t.view(dtype)
            return t.to(self.device)
        if kind == "device":
            return self.device  # restored state lives where the model runs now
        if kind == "dtype":
            return getattr(torch, node["v"])
        return super().decode_leaf(node, arrays)
