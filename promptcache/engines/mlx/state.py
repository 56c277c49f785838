"""Conversion between mlx-lm cache objects and core payloads, one adapter per cache kind.

A model's cache is a list with one object per layer; a ``CacheList`` layer holds several (its
adapter splits it into slots). ``KVCache`` and ``QuantizedKVCache`` are positional: their arrays
(2 and 6) are sliced per block along the sequence axis. ``RotatingKVCache`` (a ring),
``ArraysCache`` (SSM/conv state) and every unregistered kind are snapshot state, copied whole into
checkpoints. Only the classes' public ``state``, ``offset`` and ``trim`` are used.

MLX arrays are immutable values but ``a[i] = x`` rebinds the Python object in place, so every
array kept outside the live cache is a new array object, and state handed back is copied again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from promptcache.core.codec import PayloadCodec
from promptcache.engines.mlx.codec import MlxCodec
from promptcache.serving.block_scheme import BlockPacker, unpack_hit
from promptcache.serving.layers import AdapterRegistry, Layout


class Slot(NamedTuple):
    layer: int
    sub: int  # index inside a CacheList; -1 for a plain layer cache


def copy_state(value: Any) -> Any:
    """New array objects (same values) in fresh containers; other leaves as they are."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list | tuple):
        return type(value)(copy_state(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class MlxLayer:
    """How one mlx-lm cache kind is stored. ``num_arrays`` > 0: positional, that many arrays
    with the sequence on axis -2 (buffers may be longer than ``offset``: mlx-lm grows them in
    steps); 0: snapshot state (its ``state`` copied whole); ``container``: a list of caches."""

    num_arrays: int = 0
    quantized: bool = False  # state also carries group size and bits
    container: bool = False

    @property
    def positional(self) -> bool:
        return self.num_arrays > 0

    @property
    def snapshot(self) -> bool:
        return not self.num_arrays and not self.container

    def subcaches(self, c: Any) -> list[Any]:
        return list(c.caches) if self.container else [c]

    def seq_arrays(self, c: Any) -> list[mx.array]:
        if self.quantized:
            return [*c.keys, *c.values]
        return [c.keys, c.values]

    def set_arrays(self, c: Any, arrays: list[mx.array], num_tokens: int) -> None:
        if self.quantized:
            half = self.num_arrays // 2
            keys, values = tuple(arrays[:half]), tuple(arrays[half:])
            c.state = (keys, values, num_tokens, c.group_size, c.bits)
        else:
            c.state = (arrays[0], arrays[1], num_tokens)

    def crop(self, c: Any, length: int) -> None:
        c.trim(c.offset - length)

    def checkpoint(self, c: Any) -> Any:
        return copy_state(c.state)

    def restore_checkpoint(self, c: Any, state: Any) -> None:
        c.state = copy_state(state)


SNAPSHOT = MlxLayer()
LAYERS: AdapterRegistry[MlxLayer] = AdapterRegistry(default=SNAPSHOT)
LAYERS.register(KVCache, MlxLayer(num_arrays=2))
LAYERS.register(QuantizedKVCache, MlxLayer(num_arrays=6, quantized=True))  # (w, scales, biases)
LAYERS.register(RotatingKVCache, SNAPSHOT)  # a ring: positions are overwritten
LAYERS.register(ArraysCache, SNAPSHOT)  # SSM/conv state
LAYERS.register(CacheList, MlxLayer(container=True))


def iter_slots(cache: list[Any]) -> list[tuple[Slot, Any]]:
    out: list[tuple[Slot, Any]] = []
    for i, c in enumerate(cache):
        adapter = LAYERS.lookup(c)
        if adapter.container:
            out.extend((Slot(i, j), sub) for j, sub in enumerate(adapter.subcaches(c)))
        else:
            out.append((Slot(i, -1), c))
    return out


def get_slot(cache: list[Any], slot: Slot) -> Any:
    c = cache[slot.layer]
    return LAYERS.lookup(c).subcaches(c)[slot.sub] if slot.sub >= 0 else c


def describe_cache(cache: list[Any]) -> Layout:
    slots = iter_slots(cache)
    return Layout(
        tuple(s for s, c in slots if LAYERS.lookup(c).positional),
        tuple(s for s, c in slots if LAYERS.lookup(c).snapshot),
        tuple(type(c).__name__ for _, c in slots),
    )


def slice_positional(
    cache: list[Any], layout: Layout, start: int, end: int, packer: BlockPacker | None = None
) -> Any:
    """Owning copies of every positional array for positions [start, end), evaluated: one
    stacked array when all parts share shape and dtype, else a tuple of 1-stacks. With a
    ``packer``, the block's stored form under its scheme (quantized / narrower)."""
    parts: list[mx.array] = []
    for slot in layout.positional:
        c = get_slot(cache, slot)
        parts.extend(a[..., start:end, :] for a in LAYERS.lookup(c).seq_arrays(c))
    uniform = all(p.shape == parts[0].shape and p.dtype == parts[0].dtype for p in parts)
    # stacking always allocates: a view would keep the whole step-grown buffer alive
    out = mx.stack(parts) if uniform else tuple(mx.stack([p]) for p in parts)
    mx.eval(out)
    return packer.pack(out, start) if packer is not None else out


def _part(payload: Any, i: int) -> mx.array:
    return payload[i] if isinstance(payload, mx.array) else payload[i][0]


def take_checkpoint(cache: list[Any], layout: Layout) -> tuple[Any, ...] | None:
    """Every snapshot slot's ``state`` at the current position, aligned with ``layout.snapshot``."""
    if not layout.snapshot:
        return None
    slots = [get_slot(cache, slot) for slot in layout.snapshot]
    ckpt = tuple(LAYERS.lookup(c).checkpoint(c) for c in slots)
    mx.eval(ckpt)
    return ckpt


def restore_cache(
    fresh: list[Any],
    layout: Layout,
    segments: list[tuple[Any, int]],
    checkpoint: tuple[Any, ...] | None,
    packer: BlockPacker | None = None,
) -> list[Any]:
    """Fill ``fresh`` (a new cache list for the model) with a hit: block segments (payload,
    tokens used) and the checkpoint at the hit's end (required with snapshot slots). A
    ``packer`` turns stored blocks back into the model's arrays (checkpoints are never packed)."""
    if not segments:
        return fresh
    segments = unpack_hit(layout, segments, checkpoint, packer)
    num_tokens = sum(count for _, count in segments)
    k = 0
    for slot in layout.positional:
        c = get_slot(fresh, slot)
        adapter = LAYERS.lookup(c)
        arrays = []
        for _ in range(adapter.num_arrays):
            arrays.append(mx.concatenate([_part(p, k)[..., :n, :] for p, n in segments], axis=-2))
            k += 1
        adapter.set_arrays(c, arrays, num_tokens)
    for slot, state in zip(layout.snapshot, checkpoint or (), strict=True):
        c = get_slot(fresh, slot)
        LAYERS.lookup(c).restore_checkpoint(c, state)
    # evaluated now: the next step may run on another consumer's thread, and a lazy array can
    # only be evaluated on the thread whose (per-thread) MLX stream built it
    mx.eval([c.state for _, c in iter_slots(fresh)])
    return fresh


def crop_positional(cache: list[Any], layout: Layout, length: int) -> None:
    """Cut every positional slot back to ``length`` tokens (only valid without snapshot slots)."""
    for slot in layout.positional:
        c = get_slot(cache, slot)
        LAYERS.lookup(c).crop(c, length)


def evaluate_module(module: Any) -> None:
    """Evaluate every array a model holds, private ones too (YaRN's ``_freqs`` are outside
    ``parameters()``): MLX evaluates an array on its creating thread's stream, and the steps run
    on the scheduler's stepping thread, not the one that loaded the model."""
    mx.eval([v for _, v in tree_flatten(module) if isinstance(v, mx.array)])


class MlxCacheSteps:
    """The runner steps every MLX runner takes the same way on its list of layer caches
    (``ModelRunner``'s slice/checkpoint/restore/crop, logits to numpy, the codec); the runner
    provides ``layout``, ``packer`` and ``new_state``."""

    layout: Layout
    packer: BlockPacker | None

    def new_state(self, num_positions: int = 0) -> list[Any]:
        raise NotImplementedError

    def slice_block(self, state: list[Any], start: int, end: int) -> Any:
        return slice_positional(state, self.layout, start, end, self.packer)

    def take_checkpoint(self, state: list[Any]) -> Any:
        return take_checkpoint(state, self.layout)

    def restore(
        self, segments: list[tuple[Any, int]], checkpoint: Any, num_positions: int = 0
    ) -> list[Any]:
        state = self.new_state(num_positions)
        return restore_cache(state, self.layout, segments, checkpoint, self.packer)

    def crop(self, state: list[Any], length: int) -> None:
        crop_positional(state, self.layout, length)

    def compact(self, state: list[Any]) -> list[Any]:
        return state  # a batch's rows come back as their own arrays (``extract``)

    def fixed_bytes(self, state: list[Any]) -> int:
        parts = [p for c in state for p in (c.caches if isinstance(c, CacheList) else (c,))]
        return sum(
            v.nbytes
            for p in parts
            if isinstance(p, ArraysCache)
            for _, v in tree_flatten(p.state)
            if isinstance(v, mx.array)
        )

    def held_bytes(self, states: Sequence[list[Any]]) -> int:
        arrays = {
            id(v): v
            for state in states
            for layer in state
            for _, v in tree_flatten(getattr(layer, "state", ()))
            if isinstance(v, mx.array)
        }
        return sum(a.nbytes for a in arrays.values())

    def to_numpy(self, logits: mx.array) -> np.ndarray:
        return np.asarray(logits.astype(mx.float32))

    def codec(self) -> PayloadCodec:
        return MlxCodec()
