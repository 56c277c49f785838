"""Conversion between mlx-lm cache objects and core payloads.

A model's cache is a list with one object per layer; a ``CacheList`` layer holds several.
``KVCache`` and ``QuantizedKVCache`` are positional: their arrays are sliced per block along the
sequence axis. Every other kind (``RotatingKVCache`` ring, ``ArraysCache`` SSM/conv state, ...)
is snapshot state, copied whole into checkpoints. Only the classes' public ``state``, ``offset``
and ``trim`` are used; mlx-lm is never patched.

MLX arrays are immutable values but ``a[i] = x`` rebinds the Python object in place, so every
array kept outside the live cache is a new array object, and state handed back is copied again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

POSITIONAL_TYPES = (KVCache, QuantizedKVCache)


class Slot(NamedTuple):
    layer: int
    sub: int  # index inside a CacheList; -1 for a plain layer cache


class MlxLayout(NamedTuple):
    positional: tuple[Slot, ...]
    snapshot: tuple[Slot, ...]
    kinds: tuple[str, ...]  # class name per slot, for the logs

    @property
    def requires_checkpoint(self) -> bool:
        return bool(self.snapshot)

    @property
    def has_positional(self) -> bool:
        return bool(self.positional)


def iter_slots(cache: list[Any]) -> list[tuple[Slot, Any]]:
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            out.extend((Slot(i, j), sub) for j, sub in enumerate(c.caches))
        else:
            out.append((Slot(i, -1), c))
    return out


def get_slot(cache: list[Any], slot: Slot) -> Any:
    c = cache[slot.layer]
    return c.caches[slot.sub] if slot.sub >= 0 else c


def describe_cache(cache: list[Any]) -> MlxLayout:
    positional, snapshot, kinds = [], [], []
    for slot, c in iter_slots(cache):
        (positional if isinstance(c, POSITIONAL_TYPES) else snapshot).append(slot)
        kinds.append(type(c).__name__)
    return MlxLayout(tuple(positional), tuple(snapshot), tuple(kinds))


def _seq_arrays(c: Any) -> list[mx.array]:
    """A positional cache's arrays, each with the sequence on axis -2 (buffers may be longer than
    ``offset``: mlx-lm grows them in steps)."""
    if isinstance(c, QuantizedKVCache):
        return [*c.keys, *c.values]
    return [c.keys, c.values]


def slice_positional(cache: list[Any], layout: MlxLayout, start: int, end: int) -> Any:
    """Owning copies of every positional array for positions [start, end), evaluated: one
    stacked array when all parts share shape and dtype, else a tuple of 1-stacks."""
    parts = [
        a[..., start:end, :]
        for slot in layout.positional
        for a in _seq_arrays(get_slot(cache, slot))
    ]
    uniform = all(p.shape == parts[0].shape and p.dtype == parts[0].dtype for p in parts)
    # stacking always allocates: a view would keep the whole step-grown buffer alive
    out = mx.stack(parts) if uniform else tuple(mx.stack([p]) for p in parts)
    mx.eval(out)
    return out


def _part(payload: Any, i: int) -> mx.array:
    return payload[i] if isinstance(payload, mx.array) else payload[i][0]


def copy_state(value: Any) -> Any:
    """New array objects (same values) in fresh containers; other leaves as they are."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list | tuple):
        return type(value)(copy_state(v) for v in value)
    return value


def take_checkpoint(cache: list[Any], layout: MlxLayout) -> tuple[Any, ...] | None:
    """Every snapshot slot's ``state`` at the current position, aligned with ``layout.snapshot``."""
    if not layout.snapshot:
        return None
    ckpt = tuple(copy_state(get_slot(cache, slot).state) for slot in layout.snapshot)
    mx.eval(ckpt)
    return ckpt


def restore_cache(
    fresh: list[Any],
    layout: MlxLayout,
    segments: list[tuple[Any, int]],
    checkpoint: tuple[Any, ...] | None,
) -> list[Any]:
    """Fill ``fresh`` (a new cache list for the model) with a hit: block segments (payload,
    tokens used) and the checkpoint at the hit's end (required with snapshot slots)."""
    if not segments:
        return fresh
    if layout.snapshot and checkpoint is None:
        raise ValueError("a hit on a model with snapshot layers needs a checkpoint")
    num_tokens = sum(count for _, count in segments)
    k = 0
    for slot in layout.positional:
        c = get_slot(fresh, slot)
        arrays = []
        for _ in range(6 if isinstance(c, QuantizedKVCache) else 2):
            arrays.append(
                mx.concatenate([_part(p, k)[..., :count, :] for p, count in segments], axis=-2)
            )
            k += 1
        if isinstance(c, QuantizedKVCache):
            c.state = (tuple(arrays[:3]), tuple(arrays[3:]), num_tokens, c.group_size, c.bits)
        else:
            c.state = (arrays[0], arrays[1], num_tokens)
    for slot, state in zip(layout.snapshot, checkpoint or (), strict=True):
        get_slot(fresh, slot).state = copy_state(state)
    return fresh


def crop_positional(cache: list[Any], layout: MlxLayout, length: int) -> None:
    """Cut every positional slot back to ``length`` tokens (only valid without snapshot slots)."""
    for slot in layout.positional:
        c = get_slot(cache, slot)
        c.trim(c.offset - length)
