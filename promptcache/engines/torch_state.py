"""Conversion between transformers cache objects and core payloads.

A full-attention layer (``DynamicLayer``) is positional: its keys/values are sliced per block.
Every other layer kind (sliding window ring, Mamba conv/recurrent states, linear attention) is
snapshot state: its whole state is copied into a checkpoint valid at exactly one position.
Layers that mix both (linear attention + full attention) contribute to both.
Only the cache objects' public attributes are read and written; transformers is never patched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

POSITIONAL_ATTRS = ("keys", "values")


class LayerLayout(NamedTuple):
    positional: tuple[int, ...]  # layer indices whose keys/values are stored per block
    snapshot: tuple[int, ...]  # layer indices stored in checkpoints
    kinds: tuple[str, ...]  # class name per layer, for the fingerprint and the logs

    @property
    def requires_checkpoint(self) -> bool:
        return bool(self.snapshot)

    @property
    def has_positional(self) -> bool:
        return bool(self.positional)


def _is_positional(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False)


def _has_snapshot_state(layer: Any) -> bool:
    # a pure DynamicLayer holds nothing but keys/values and bookkeeping
    return type(layer) is not DynamicLayer


def describe_layers(cache: DynamicCache) -> LayerLayout:
    """Classify the layers of a cache that has seen at least one forward pass."""
    positional, snapshot = [], []
    for i, layer in enumerate(cache.layers):
        if _is_positional(layer):
            positional.append(i)
        if _has_snapshot_state(layer):
            snapshot.append(i)
    return LayerLayout(
        tuple(positional), tuple(snapshot), tuple(type(x).__name__ for x in cache.layers)
    )


def slice_positional(
    cache: DynamicCache, layout: LayerLayout, start: int, end: int
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """An owning copy of keys and values for positions [start, end): item 2j is positional layer
    j's keys, 2j+1 its values. One stacked tensor when all layers have the same shape: one
    allocation per block instead of two per layer (and one array per block file)."""
    parts: list[torch.Tensor] = []
    for i in layout.positional:
        layer = cache.layers[i]
        parts.append(layer.keys[:, :, start:end, :])
        parts.append(layer.values[:, :, start:end, :])
    if all(p.shape == parts[0].shape and p.dtype == parts[0].dtype for p in parts):
        return torch.stack(parts)
    return tuple(p.clone() for p in parts)


def _copy_value(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_value(v) for v in value)
    return value


def take_checkpoint(cache: DynamicCache, layout: LayerLayout) -> dict[int, dict[str, Any]] | None:
    """Snapshot state of every snapshot layer at the cache's current position (copies)."""
    if not layout.snapshot:
        return None
    ckpt: dict[int, dict[str, Any]] = {}
    for i in layout.snapshot:
        layer = cache.layers[i]
        skip = POSITIONAL_ATTRS if _is_positional(layer) else ()
        ckpt[i] = {k: _copy_value(v) for k, v in vars(layer).items() if k not in skip}
    return ckpt


def restore_cache(
    config: Any,
    layout: LayerLayout,
    segments: list[tuple[tuple[torch.Tensor, ...], int]],
    checkpoint: dict[int, dict[str, Any]] | None,
    device: torch.device,
) -> DynamicCache:
    """A fresh cache holding the state of a hit: block segments (payload, tokens used) and the
    checkpoint at the hit's end (required when the layout has snapshot layers)."""
    cache = DynamicCache(config=config)
    if not segments:
        return cache
    if layout.snapshot and checkpoint is None:
        raise ValueError("a hit on a model with snapshot layers needs a checkpoint")
    for j, i in enumerate(layout.positional):
        keys = torch.cat(
            [payload[2 * j][:, :, :count, :] for payload, count in segments], dim=2
        ).to(device)
        values = torch.cat(
            [payload[2 * j + 1][:, :, :count, :] for payload, count in segments], dim=2
        ).to(device)
        layer = cache.layers[i]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    for i, state in (checkpoint or {}).items():
        layer = cache.layers[i]
        for k, v in state.items():
            setattr(layer, k, _copy_value(v).to(device) if torch.is_tensor(v) else _copy_value(v))
    return cache


def crop_positional(cache: DynamicCache, layout: LayerLayout, length: int) -> None:
    """Cut every positional layer back to its first ``length`` positions (views, no copy).
    Only valid for a layout without snapshot layers, or when nothing is cut."""
    for i in layout.positional:
        layer = cache.layers[i]
        layer.keys = layer.keys[:, :, :length, :]
        layer.values = layer.values[:, :, :length, :]
