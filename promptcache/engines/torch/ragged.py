"""Ragged decode: many requests' next tokens in one lean forward, each row attending over its
own keys/values where they are (no padded batch).

A padded batch (``batch.py``) copies every row's keys/values into one tensor whenever a request
joins or leaves; under many sessions at once rows change every step or two and that copy, of
every live context, is most of the step. Here each request keeps a buffer of its own with room
to grow (``RowBuffer``): the projections, norms and MLP run over all rows at once and only the
attention runs row by row, the new token written in place. A row is copied only when it joins
(or when something outside changed its state: a prefill forward, a crop, a compaction).

Only the lean step (``lean.LeanDecoder``) runs this: it owns the attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from promptcache.engines.torch.lean import LeanDecoder, Output, _rms

ROOM = 128  # positions allocated ahead of a row (a reallocation every ROOM decode steps)


@dataclass(slots=True)
class RowBuffer:
    """One request's keys/values per layer in buffers ``[1, kv_heads, capacity, dim]``; the
    first ``length`` positions are its context. ``views`` are what its state's layers held after
    our last step: while they still do, nobody else changed the state and the buffer is current.
    Positions below ``length`` are never written again (views of them may be held elsewhere)."""

    state: DynamicCache
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    views: list[tuple[torch.Tensor, torch.Tensor]]

    def is_current(self, state: DynamicCache) -> bool:
        layers = state.layers
        return state is self.state and all(
            layers[j].keys is k and layers[j].values is v for j, (k, v) in enumerate(self.views)
        )

    def reserve(self, total: int) -> None:
        if total <= self.keys[0].shape[2]:
            return
        self.keys = [_with_room(t, self.length, total) for t in self.keys]
        self.values = [_with_room(t, self.length, total) for t in self.values]

    def hand_out(self) -> None:
        """The state's layers become views of the first ``length`` positions (no copy)."""
        n = self.length
        self.views = [
            (k[:, :, :n], v[:, :, :n]) for k, v in zip(self.keys, self.values, strict=True)
        ]
        for layer, (k, v) in zip(self.state.layers, self.views, strict=True):
            layer.keys, layer.values = k, v


def _with_room(t: torch.Tensor, used: int, total: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], total + ROOM, t.shape[3]))
    out[:, :, :used] = t[:, :, :used]  # the rest is written before it is read
    return out


def adopt(state: DynamicCache) -> RowBuffer:
    """A buffer of ``state``'s context (one copy) with room ahead."""
    length = state.layers[0].get_seq_length()
    row = RowBuffer(state, [], [], length, [])
    for layer in state.layers:
        row.keys.append(_with_room(layer.keys, length, length))
        row.values.append(_with_room(layer.values, length, length))
    return row


class RaggedRows:
    """The decoding requests' buffers, kept from step to step: a row that is still current is
    reused, a new or changed one adopted, one that stopped decoding dropped (its state keeps
    its views: the buffer lives while they do)."""

    def __init__(self) -> None:
        self._rows: dict[int, RowBuffer] = {}

    def rows_for(self, states: Sequence[DynamicCache]) -> list[RowBuffer]:
        kept: dict[int, RowBuffer] = {}
        for state in states:
            row = self._rows.get(id(state))
            if row is None or not row.is_current(state):
                row = adopt(state)
            kept[id(state)] = row  # the row holds its state: its id is not reused meanwhile
        self._rows = kept
        return list(kept.values())

    def clear(self) -> None:
        self._rows = {}

    def held(self) -> list[DynamicCache]:
        return [row.state for row in self._rows.values()]


@torch.inference_mode()
def ragged_decode(
    decoder: LeanDecoder, rows_of: RaggedRows, states: Sequence[DynamicCache], tokens: Sequence[int]
) -> list[torch.Tensor]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward: each row's logits."""
    rows = rows_of.rows_for(states)
    device = rows[0].keys[0].device
    lengths = [row.length for row in rows]
    for row in rows:
        row.reserve(row.length + 1)
    ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=device)
    position_ids = torch.tensor([[n] for n in lengths], dtype=torch.long, device=device)
    h = decoder.embed(ids)
    cos, sin = decoder.rotary(h, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1 (heads), 1, dim]
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)
    heads, kv_heads = decoder.num_heads, decoder.num_kv_heads
    gqa = heads != kv_heads
    num_rows = len(rows)
    for i, layer in enumerate(decoder.layers):
        x = _rms(layer.norm1, h)
        qkv = layer.project_qkv(x)
        if layer.q_norm is not None:
            q = _rms(layer.q_norm, qkv[:, :, :heads])
            k = _rms(layer.k_norm, qkv[:, :, heads : heads + kv_heads])
            qk = torch.cat((q, k), 2).transpose(1, 2)
        else:
            qk = qkv[:, :, : heads + kv_heads].transpose(1, 2)
        qk = qk * cos + qk.roll(half, -1) * signed_sin
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        outs = []
        for r, row in enumerate(rows):
            n = lengths[r]
            kbuf, vbuf = row.keys[i], row.values[i]
            kbuf[0, :, n] = qk[r, heads:, 0]
            vbuf[0, :, n] = v[r, :, 0]
            outs.append(F.scaled_dot_product_attention(
                qk[r : r + 1, :heads], kbuf[:, :, : n + 1], vbuf[:, :, : n + 1],
                scale=layer.scaling, enable_gqa=gqa,
            ))  # fmt: skip
        o = outs[0] if num_rows == 1 else torch.cat(outs, 0)
        h = h + layer.o_proj(o.transpose(1, 2).reshape(num_rows, 1, -1))
        h = h + layer.mlp(_rms(layer.norm2, h))
    logits = Output(decoder.model.lm_head(decoder.norm(h))).logits
    for row in rows:
        row.length += 1
        row.hand_out()
    return [logits[r, -1] for r in range(num_rows)]
