"""Batched decode on transformers: one forward for many requests' next tokens.

Each request keeps its own ``DynamicCache`` (the prompt cache slices, checkpoints and restores
per request). A decode step gathers them into one left-padded batch: every layer's keys/values
are copied right-aligned into a ``[B, heads, L, dim]`` tensor (L the longest sequence), a 2-D
``attention_mask`` hides the padding, and ``position_ids`` give each row its own position (RoPE
must not see the padding). After the forward each request's layer takes back a *view* of its row
(the padding cut off): no copy back. While the same requests keep decoding, the next step
reuses the padded batch as it is (``DecodeBatch``): the gather copy is paid only when a request
joins or leaves.

Only layouts whose every layer is a plain ``DynamicLayer`` batch: a sliding-window ring
(gemma3) holds a different length per layer and a linear-attention/SSM layer (mamba, jamba,
bamba) carries convolution state that transformers' masks do not describe; those models decode
one sequence per forward (same results, no batching gain). Only the public cache API is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from promptcache.engines.layers import Layout


def can_batch(layout: Layout) -> bool:
    """True when every layer is full attention (keys/values only): padding + mask is exact."""
    return not layout.snapshot and all(k == DynamicLayer.__name__ for k in layout.kinds)


@dataclass(slots=True)
class DecodeBatch:
    """The last step's padded batch, kept for the next one: while the same requests decode and
    nobody else touched their state, the next step appends to it without gathering again (a
    join, a leave, a crop or a restore changes a layer's tensor identity: then it is rebuilt)."""

    states: list[DynamicCache]  # row order
    cache: DynamicCache  # [rows, heads, width, dim] per layer, rows right-aligned
    lengths: list[int]  # real positions per row (the rest of ``width`` is left padding)
    views: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per row, per layer: what we handed out

    def covers(self, states: Sequence[DynamicCache]) -> bool:
        return (
            len(states) == len(self.states)
            and all(a is b for a, b in zip(states, self.states, strict=True))
            and all(
                layer.keys is k and layer.values is v
                for state, row in zip(states, self.views, strict=True)
                for layer, (k, v) in zip(state.layers, row, strict=True)
            )
        )


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer with room to grow: a decode
    token is written in place (``DynamicLayer.update`` concatenates: a fresh allocation and a
    copy of the whole layer for every token). Positions already handed out as views are never
    written again, so requests holding them see no change."""

    ROOM = 128  # positions allocated ahead (a reallocation every ROOM decode steps)

    def fill(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.lazy_initialization(keys, values)
        self._bufs = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, new = self.keys.shape[-2], key_states.shape[-2]
        kbuf, vbuf = self._bufs
        if n + new > kbuf.shape[-2]:
            kbuf = _grow(kbuf, n, new + self.ROOM)
            vbuf = _grow(vbuf, n, new + self.ROOM)
            self._bufs = (kbuf, vbuf)
        kbuf[:, :, n : n + new] = key_states
        vbuf[:, :, n : n + new] = value_states
        self.keys, self.values = kbuf[:, :, : n + new], vbuf[:, :, : n + new]
        return self.keys, self.values


def _grow(buf: torch.Tensor, used: int, more: int) -> torch.Tensor:
    shape = (*buf.shape[:2], used + more, buf.shape[3])
    out = buf.new_empty(shape)  # past ``used``: written before it is read
    out[:, :, :used] = buf[:, :, :used]
    return out


def gather(model: Any, states: Sequence[DynamicCache]) -> DecodeBatch:
    """Copy every request's keys/values right-aligned into one padded batch cache."""
    lengths = [s.get_seq_length() for s in states]
    longest, rows = max(lengths), len(states)
    batch = DynamicCache(config=model.config)
    for j in range(len(batch.layers)):
        parts = [s.layers[j] for s in states]
        k0, v0 = parts[0].keys, parts[0].values
        room = longest + GrowingLayer.ROOM
        # uninitialised but the left padding: the room ahead is written before it is read,
        # and padding must be finite (masked scores weigh it by 0, and 0 * NaN is NaN)
        keys = k0.new_empty((rows, k0.shape[1], room, k0.shape[3]))
        values = v0.new_empty((rows, v0.shape[1], room, v0.shape[3]))
        for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
            keys[i, :, : longest - n].zero_()
            values[i, :, : longest - n].zero_()
            keys[i, :, longest - n : longest] = part.keys[0]
            values[i, :, longest - n : longest] = part.values[0]
        layer = GrowingLayer()
        layer.fill(keys, values, longest)
        batch.layers[j] = layer  # our own cache object: its layers are ours to choose
    return DecodeBatch(list(states), batch, lengths, [])


def batched_decode(
    model: Any,
    cache_arg: str,
    states: Sequence[DynamicCache],
    tokens: Sequence[int],
    last: DecodeBatch | None,
    positions: Callable[[list[int]], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], DecodeBatch]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward: each row's logits, and
    the batch to pass back as ``last`` next step. ``positions``: the rows' ``position_ids``
    from their real lengths (a 3-D RoPE model's, ``torch.mrope``); default the lengths."""
    batch = last if last is not None and last.covers(states) else gather(model, states)
    lengths, rows = batch.lengths, len(states)
    width = batch.cache.get_seq_length()
    device = batch.cache.layers[0].keys.device
    # the mask covers the cached positions and the new one; padding is the left part of a row
    mask = torch.zeros((rows, width + 1), dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    out = model(
        input_ids=torch.tensor([[t] for t in tokens], dtype=torch.long, device=device),
        attention_mask=mask,
        position_ids=(
            torch.tensor([[n] for n in lengths], dtype=torch.long, device=device)
            if positions is None
            else positions(lengths)
        ),
        use_cache=True,
        logits_to_keep=1,
        **{cache_arg: batch.cache},
    )
    # each request's layers become views of its row (the padding cut off): no copy back
    batch.lengths = [n + 1 for n in lengths]
    batch.views = []
    for i, state in enumerate(states):
        start = width - lengths[i]  # the row's first real position; the new token is the last
        row = []
        for j, layer in enumerate(batch.cache.layers):
            k = layer.keys[i : i + 1, :, start:]
            v = layer.values[i : i + 1, :, start:]
            state.layers[j].keys, state.layers[j].values = k, v
            row.append((k, v))
        batch.views.append(row)
    return [out.logits[i, -1] for i in range(rows)], batch
