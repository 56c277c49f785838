"""Conversion between transformers cache objects and core payloads, one adapter per layer kind.

A full-attention layer (``DynamicLayer``) is positional: its keys/values are sliced per block.
A sliding-window ring, Mamba conv/recurrent states and linear attention are snapshot state: the
layer's whole state is copied into a checkpoint valid at exactly one position. A layer that mixes
both (linear + full attention) contributes to both. Unregistered kinds are snapshot state.
Only the cache objects' public attributes are read and written; transformers is never patched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from promptcache.engines.torch.buffers import POOL
from promptcache.serving.block_scheme import BlockPacker, unpack_hit
from promptcache.serving.layers import AdapterRegistry, Layout

POSITIONAL_ATTRS = ("keys", "values")
LINEAR_STATE_ATTRS = ("conv_states", "recurrent_states")  # dicts by state index
Segments = list[tuple[torch.Tensor, int]]  # a hit's blocks of one layer: (tensor, positions used)


def _copy_value(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_value(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class TorchLayer:
    """How one transformers layer kind is stored: its ``keys``/``values`` per block
    (``positional``) and/or every other attribute in checkpoints (``snapshot``)."""

    positional: bool
    snapshot: bool

    def keys_values(self, layer: Any, start: int, end: int) -> list[torch.Tensor]:
        return [layer.keys[:, :, start:end, :], layer.values[:, :, start:end, :]]

    def set_keys_values(self, layer: Any, keys: Segments, values: Segments, device: Any) -> None:
        """Fill a fresh ``layer`` with the positions of a hit: (tensor, positions used) each."""
        k, v = gather_positions(keys, device), gather_positions(values, device)
        layer.lazy_initialization(k, v)  # dtype/device bookkeeping of a fresh layer
        layer.keys, layer.values = k, v

    def crop(self, layer: Any, length: int) -> None:
        layer.keys = layer.keys[:, :, :length, :]  # views: the next forward concatenates anyway
        layer.values = layer.values[:, :, :length, :]

    def checkpoint(self, layer: Any) -> dict[str, Any]:
        skip = POSITIONAL_ATTRS if self.positional else ()  # those travel in the blocks
        return {k: _copy_value(v) for k, v in vars(layer).items() if k not in skip}

    def restore_checkpoint(self, layer: Any, state: dict[str, Any], device: torch.device) -> None:
        for k, v in state.items():
            setattr(layer, k, _copy_value(v).to(device) if torch.is_tensor(v) else _copy_value(v))


FULL_ATTENTION = TorchLayer(positional=True, snapshot=False)
SNAPSHOT = TorchLayer(positional=False, snapshot=True)
HYBRID = TorchLayer(positional=True, snapshot=True)
STATELESS = TorchLayer(positional=False, snapshot=False)  # holds nothing: nothing to store

LAYERS: AdapterRegistry[TorchLayer] = AdapterRegistry(default=SNAPSHOT)
LAYERS.register(DynamicLayer, FULL_ATTENTION)
LAYERS.register(DynamicSlidingWindowLayer, SNAPSHOT)  # a ring: positions are overwritten
LAYERS.register(LinearAttentionLayer, SNAPSHOT)  # conv + recurrent state (Mamba, ...)
LAYERS.register(LinearAttentionAndFullAttentionLayer, HYBRID)
LAYERS.register(DummyLayer, STATELESS)  # an MLP-only layer (Nemotron-H) or a shared-cache one


def describe_layers(cache: DynamicCache) -> Layout:
    """Which layers of a fresh cache are positional and which are snapshot state."""
    adapters = [LAYERS.lookup(layer) for layer in cache.layers]
    return Layout(
        tuple(i for i, a in enumerate(adapters) if a.positional),
        tuple(i for i, a in enumerate(adapters) if a.snapshot),
        tuple(type(x).__name__ for x in cache.layers),
    )


def slice_positional(
    cache: DynamicCache, layout: Layout, start: int, end: int, packer: BlockPacker | None = None
) -> Any:
    """An owning copy of keys and values for positions [start, end): item 2j is positional layer
    j's keys, 2j+1 its values. One stacked tensor when all layers have the same shape: one
    allocation per block instead of two per layer (and one array per block file). With a
    ``packer``, the block's stored form under its scheme (quantized / narrower)."""
    parts: list[torch.Tensor] = []
    for i in layout.positional:
        layer = cache.layers[i]
        parts.extend(LAYERS.lookup(layer).keys_values(layer, start, end))
    if all(p.shape == parts[0].shape and p.dtype == parts[0].dtype for p in parts):
        block: Any = torch.stack(parts)
    else:
        block = tuple(p.clone() for p in parts)
    return packer.pack(block, start) if packer is not None else block


def take_checkpoint(cache: DynamicCache, layout: Layout) -> dict[int, dict[str, Any]] | None:
    """Snapshot state of every snapshot layer at the cache's current position (copies)."""
    if not layout.snapshot:
        return None
    return {i: LAYERS.lookup(cache.layers[i]).checkpoint(cache.layers[i]) for i in layout.snapshot}


def restore_cache(
    cache: DynamicCache,
    layout: Layout,
    segments: list[tuple[Any, int]],
    checkpoint: dict[int, dict[str, Any]] | None,
    device: torch.device,
    packer: BlockPacker | None = None,
) -> DynamicCache:
    """Fill a fresh ``cache`` with the state of a hit: block segments (payload, tokens used) and
    the checkpoint at the hit's end (required when the layout has snapshot layers). A
    ``packer`` turns stored blocks back into the model's arrays (checkpoints are never packed)."""
    if not segments:
        return cache
    segments = unpack_hit(layout, segments, checkpoint, packer)
    for j, i in enumerate(layout.positional):
        keys = [(p[2 * j], n) for p, n in segments]
        values = [(p[2 * j + 1], n) for p, n in segments]
        LAYERS.lookup(cache.layers[i]).set_keys_values(cache.layers[i], keys, values, device)
    for i, state in (checkpoint or {}).items():
        LAYERS.lookup(cache.layers[i]).restore_checkpoint(cache.layers[i], state, device)
    return cache


def gather_positions(parts: Segments, device: Any, capacity: int | None = None) -> torch.Tensor:
    """The positions used of each part, one after another, in one buffer on ``device`` of
    ``capacity`` positions (default: just those; the rest is written before it is read). A
    pooled buffer on a CPU (``buffers.POOL``)."""
    first = parts[0][0]
    n = sum(used for _, used in parts)
    shape = (first.shape[0], first.shape[1], n if capacity is None else capacity, first.shape[3])
    if torch.device(device).type == "cpu":
        out = POOL.empty(shape, first.dtype)
    else:
        out = torch.empty(shape, dtype=first.dtype, device=device)
    at = 0
    for part, used in parts:
        out[:, :, at : at + used] = part[:, :, :used]
        at += used
    return out


def crop_positional(cache: DynamicCache, layout: Layout, length: int) -> None:
    """Cut every positional layer back to its first ``length`` positions (views, no copy).
    Only valid for a layout without snapshot layers, or when nothing is cut."""
    for i in layout.positional:
        LAYERS.lookup(cache.layers[i]).crop(cache.layers[i], length)


def held_bytes(caches: Sequence[Any]) -> int:
    """Bytes of the distinct buffers ``caches`` keep alive: a view of a larger buffer (a decode
    batch's row) counts that whole buffer, and a buffer several caches share counts once."""
    seen: dict[int, int] = {}
    for cache in caches:
        for layer in getattr(cache, "layers", ()):
            for t in layer_tensors(layer):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def layer_tensors(layer: Any) -> list[torch.Tensor]:
    """The tensors a layer's attributes hold, in tuples, lists and dicts (an SSM layer's
    conv/recurrent states are dicts by state index) too."""
    found: list[torch.Tensor] = []
    for value in vars(layer).values() if hasattr(layer, "__dict__") else ():
        items = value.values() if isinstance(value, dict) else value
        for t in items if isinstance(value, tuple | list | dict) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def compact_views(layer: Any) -> None:
    """Replace the layer's keys/values, and an SSM layer's states, that view a larger buffer (a
    decode batch's row) by a copy of just what they view, so the buffer can go."""
    for name in POSITIONAL_ATTRS:
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and _is_view(t):
            setattr(layer, name, t.clone())  # exact: a pooled copy would look like a view
    for name in LINEAR_STATE_ATTRS:
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            for idx, t in states.items():
                if isinstance(t, torch.Tensor) and _is_view(t):
                    states[idx] = t.clone()


def _is_view(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.nbytes
