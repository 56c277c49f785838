"""Full-attention cache layers that grow in place: a decode batch's layers (``batch.py``).

``GrowingLayer`` holds keys/values as views of buffers with room ahead, so a decode token is one
write rather than transformers' concatenation (a fresh allocation and a copy of the whole layer
for every token). ``GrowingHybridLayer`` is the same beside linear-attention state in one layer
(Falcon-H1, Zamba2: ``LinearAttentionAndFullAttentionLayer``), built as transformers builds that.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer with room to grow: a decode
    token is written in place (``DynamicLayer.update`` concatenates: a fresh allocation and a
    copy of the whole layer for every token). Positions already handed out as views are never
    written again, so requests holding them see no change. With ``at`` set (a compiled step) the
    token goes to position ``at`` and the whole buffer is returned: shapes stay static."""

    ROOM = 128  # positions allocated ahead (a reallocation every ROOM decode steps)
    at: torch.Tensor | None = None

    def fill(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.lazy_initialization(keys, values)
        self._bufs = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def reserve(self, total: int) -> None:
        """Room for ``total`` positions (a copy into a larger buffer when there is not)."""
        kbuf, vbuf = self._bufs
        n = self.keys.shape[-2]
        if total > kbuf.shape[-2]:
            self._bufs = (
                _grow(kbuf, n, total - n + self.ROOM),
                _grow(vbuf, n, total - n + self.ROOM),
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kbuf, vbuf = self._bufs
        if self.at is not None:  # compiled: static shapes, the mask hides the unwritten rest
            kbuf.index_copy_(2, self.at, key_states)
            vbuf.index_copy_(2, self.at, value_states)
            return kbuf, vbuf
        n, new = self.keys.shape[-2], key_states.shape[-2]
        self.reserve(n + new)
        kbuf, vbuf = self._bufs
        kbuf[:, :, n : n + new] = key_states
        vbuf[:, :, n : n + new] = value_states
        self.keys, self.values = kbuf[:, :, : n + new], vbuf[:, :, : n + new]
        return self.keys, self.values


def _grow(buf: torch.Tensor, used: int, more: int) -> torch.Tensor:
    out = new_buffer(buf, buf.shape[0], used + more, used)
    out[:, :, :used] = buf[:, :, :used]
    return out


def new_buffer(like: torch.Tensor, rows: int, length: int, used: int) -> torch.Tensor:
    """A ``rows`` x heads x ``length`` x dim buffer like ``like``, zero past ``used``: a compiled
    step reads the room ahead under a mask, and masked scores weigh it by 0 (0 * NaN is NaN)."""
    out = like.new_empty((rows, like.shape[1], length, like.shape[3]))
    out[:, :, used:].zero_()
    return out


class GrowingHybridLayer(LinearAttentionLayer, GrowingLayer):
    """A ``GrowingLayer`` that also holds linear-attention conv/recurrent state: what a batch
    makes of ``LinearAttentionAndFullAttentionLayer`` rows (keys grown, states stacked)."""

    def __init__(self, number_of_states: int = 1) -> None:
        GrowingLayer.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and not kwargs:  # keys, values (``update``)
            GrowingLayer.lazy_initialization(self, *args)
        else:  # conv or recurrent state, by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return DynamicLayer.get_seq_length(self)
