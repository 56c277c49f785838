"""The layers of a decode batch that do not grow in place: each row's state stacked into one
batch layer before the forward, and handed back as views of its row after it.

- A sliding-window ring (gemma3, gpt-oss) keeps a row's last ``window - 1`` positions. Left
  padding puts each row's last positions in the batch's last slots, so one
  ``DynamicSlidingWindowLayer`` over the padded frame holds every row's window (the padding
  masked, as for the full-attention layers).
- A linear-attention layer (Mamba's conv + SSM state, gated delta nets, short convolutions:
  ``LinearAttentionLayer``) holds fixed-size state per row, no positions: its tensors are
  concatenated along the batch. A one-token step updates each row's state from that row's
  token only (transformers gives such a step no padding mask), so padding never reaches it.

A hybrid layer (Falcon-H1: ``LinearAttentionAndFullAttentionLayer``) has both: its keys grow
in the batch (``growing.GrowingHybridLayer``) and its states stack as a linear layer's.

``held(layer)``: the tensors a row's layer holds (a hybrid's: its states; its keys are the
grown part's); a batch is reused while every row still holds the views it was handed
(``DecodeBatch.covers``). Only the layers' public attributes are read and written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import (
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from promptcache.engines.torch.state import LINEAR_STATE_ATTRS

SLIDING = DynamicSlidingWindowLayer.__name__
LINEAR = LinearAttentionLayer.__name__
HYBRID = LinearAttentionAndFullAttentionLayer.__name__


def is_linear(layer: Any) -> bool:
    """A layer of linear-attention state only."""
    return type(layer) is LinearAttentionLayer


def has_states(layer: Any) -> bool:
    """A layer with linear-attention conv/recurrent state (alone or beside attention)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def held(layer: Any) -> tuple[Any, ...]:
    """The tensors that are a row's state in ``layer`` (compared by identity)."""
    if has_states(layer):
        return (*layer.conv_states.values(), *layer.recurrent_states.values())
    return (getattr(layer, "keys", None), getattr(layer, "values", None))


def row_length(layer: Any) -> int:
    """How many positions a sliding or linear layer has seen."""
    if is_linear(layer):
        return int(layer.cumulative_length_linear)
    return int(layer.cumulative_length)


def stack_layers(parts: Sequence[Any], lengths: Sequence[int], longest: int) -> Any:
    """One batch layer holding every row's state of a sliding or linear layer."""
    if is_linear(parts[0]):
        return _stack_linear(parts, longest)
    return _stack_sliding(parts, lengths, longest)


def hand_out_rows(layer: Any, states: Sequence[Any], j: int, lengths: Sequence[int]) -> list:
    """Each row's layer ``j`` becomes views of its row of the batch ``layer`` (transformers may
    have replaced the batch layer's tensors in the forward); the views, per row."""
    if has_states(layer):
        return [_hand_out_linear(layer, s.layers[j], i, n) for i, (s, n) in enumerate(zip(states, lengths, strict=True))]  # fmt: skip
    return [_hand_out_window(layer, s.layers[j], i, n) for i, (s, n) in enumerate(zip(states, lengths, strict=True))]  # fmt: skip


def _stack_sliding(
    parts: Sequence[Any], lengths: Sequence[int], longest: int
) -> DynamicSlidingWindowLayer:
    """Row i's last min(n_i, window - 1) positions in the last slots, zeros before."""
    assert all(isinstance(p, DynamicSlidingWindowLayer) for p in parts), "sliding layers only"
    window = parts[0].sliding_window
    kept = min(longest, window - 1)
    k0, v0 = parts[0].keys, parts[0].values
    keys = k0.new_zeros((len(parts), k0.shape[1], kept, k0.shape[3]))
    values = v0.new_zeros((len(parts), v0.shape[1], kept, v0.shape[3]))
    for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
        own = part.keys.shape[-2]
        assert part.cumulative_length == n and own == min(n, window - 1), "a row's ring is off"
        keys[i, :, kept - own :] = part.keys[0]
        values[i, :, kept - own :] = part.values[0]
    layer = DynamicSlidingWindowLayer(sliding_window=window)
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values, layer.cumulative_length = keys, values, longest
    return layer


def _hand_out_window(layer: Any, own: Any, i: int, n: int) -> tuple[Any, ...]:
    kept = min(n, own.sliding_window - 1)
    width = layer.keys.shape[-2]
    k = layer.keys[i : i + 1, :, width - kept :]
    v = layer.values[i : i + 1, :, width - kept :]
    own.keys, own.values, own.cumulative_length = k, v, n
    return (k, v)


def _stack_linear(parts: Sequence[Any], longest: int) -> LinearAttentionLayer:
    layer = LinearAttentionLayer(number_of_states=parts[0].number_of_states)
    fill_linear(layer, parts, longest)
    return layer


def fill_linear(layer: Any, parts: Sequence[Any], longest: int) -> None:
    """``layer``'s (fresh) linear-attention state: every row's states concatenated along the
    batch; it counts the padded frame's positions (a hybrid model's first layer may be this
    one: ``get_seq_length`` reads it)."""
    first = parts[0]
    assert all(has_states(p) and not p.record_past for p in parts), "plain linear state only"
    for idx in range(first.number_of_states):
        begun = first.has_previous_state[idx]  # a state index the model never uses stays False
        assert all(p.has_previous_state[idx] == begun for p in parts), "rows at other stages"
        layer.has_previous_state[idx] = begun
        layer.conv_kernel_size[idx] = first.conv_kernel_size[idx]
        for name in LINEAR_STATE_ATTRS:
            if getattr(first, f"is_{name}_initialized")[idx]:
                getattr(layer, name)[idx] = torch.cat([getattr(p, name)[idx] for p in parts])
                getattr(layer, f"is_{name}_initialized")[idx] = True
    layer.device, layer.dtype = first.device, first.dtype
    layer.cumulative_length_linear = torch.tensor(longest, device=first.device)


def _hand_out_linear(layer: Any, own: Any, i: int, n: int) -> tuple[Any, ...]:
    for name in LINEAR_STATE_ATTRS:
        theirs, mine = getattr(layer, name), getattr(own, name)
        for idx, t in theirs.items():
            if t is not None:
                mine[idx] = t[i : i + 1]
    own.cumulative_length_linear.fill_(n)
    return held(own)
