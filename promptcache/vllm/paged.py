"""Copies between vLLM's paged KV (one tensor per layer, blocks on dim 0) and cache payloads.

A payload is one vLLM block of every layer as one numpy array ``[layers, *block shape]``,
its elements' raw bits as integers of the same width (numpy has no bfloat16 or fp8; the
namespace's layout records the real dtype, so bits are only ever read back as what they were).
"""

from __future__ import annotations

import numpy as np
import torch

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PagedKv:
    """The worker's view of vLLM's KV caches, layers in model order."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.names = sorted(kv_caches, key=_layer_order)
        self.layers = [kv_caches[n] for n in self.names]
        first = self.layers[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in self.layers):
            raise ValueError("promptcache connector: KV layers of different shapes or dtypes")
        self.dtype = first.dtype
        self.raw = _RAW[first.element_size()]
        self.block_shape = (len(self.layers), *first.shape[1:])

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.layers[0].element_size()

    def read_block(self, block_id: int) -> np.ndarray:
        """An owning copy of one vLLM block across all layers."""
        stacked = torch.stack([t[block_id] for t in self.layers])
        return stacked.view(self.raw).cpu().numpy()

    def write_block(self, block_id: int, payload: object) -> bool:
        """Copy a payload into one vLLM block; False when it is not this layout's."""
        if not isinstance(payload, np.ndarray) or tuple(payload.shape) != self.block_shape:
            return False
        if payload.dtype.itemsize != self.layers[0].element_size():
            return False
        src = torch.from_numpy(np.ascontiguousarray(payload)).view(self.raw).view(self.dtype)
        for layer, t in zip(self.layers, src, strict=True):
            layer[block_id].copy_(t, non_blocking=False)
        return True


def _layer_order(name: str) -> tuple:
    """Layer names by their numbers (``model.layers.10`` after ``model.layers.9``)."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))
