"""Batched decode on transformers: one forward for many requests' next tokens.

Each request keeps its own ``DynamicCache`` (the prompt cache slices, checkpoints and restores
per request). A decode step gathers them into one left-padded batch: every layer's keys/values
are copied right-aligned into a ``[B, heads, L, dim]`` tensor (L the longest sequence), a 2-D
``attention_mask`` hides the padding, and ``position_ids`` give each row its own position (RoPE
must not see the padding). After the forward each request's layer takes back a *view* of its row
(the padding cut off): no copy back. While the same requests keep decoding, the next step
reuses the padded batch as it is (``DecodeBatch``): the gather copy is paid only when a request
joins or leaves.

Besides full-attention layers, a batch holds layers that do not grow in place, stacked row by
row (``batch_stacked``): sliding-window rings (gemma3, gpt-oss) and linear-attention/SSM state
(mamba, jamba, bamba, granite hybrids, lfm2, qwen3-next); a layer holding both (falcon-h1)
grows its keys and stacks its states. Only the public cache API is used.

``step``: the forward to call (the model, or a compiled one: ``compiled.py``). A compiled step
needs static shapes: its layers write the new token at a position tensor and return their whole
buffer, and a 4-D mask (built here, in the attention implementation's form) hides what is not
yet written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer

from promptcache.engines.torch.batch_stacked import (
    HYBRID,
    LINEAR,
    SLIDING,
    fill_linear,
    hand_out_rows,
    held,
    row_length,
    stack_layers,
)
from promptcache.engines.torch.growing import GrowingHybridLayer, GrowingLayer, new_buffer
from promptcache.serving.layers import Layout

FULL = DynamicLayer.__name__
GROWN_KINDS = (FULL, HYBRID)  # a batch grows their keys in place (a hybrid's states stack)
BATCHED_KINDS = (*GROWN_KINDS, SLIDING, LINEAR, DummyLayer.__name__)


def is_full_attention(layout: Layout) -> bool:
    """True when every layer is plain full attention (keys/values only)."""
    return not layout.snapshot and all(k == DynamicLayer.__name__ for k in layout.kinds)


def can_batch(layout: Layout) -> bool:
    """True when every layer is full attention, a sliding window (alone too: Mistral 7B v0.1),
    linear-attention state or stateless, one at least holding state: padding + mask is exact."""
    kinds = set(layout.kinds)
    return bool(kinds - {DummyLayer.__name__}) and kinds <= set(BATCHED_KINDS)


def in_place_layers(layout: Layout) -> tuple[int, ...]:
    """The layers a lone decode grows in place: the full-attention ones, a hybrid's attention
    part too (any other kind is the request's own object, updated by transformers as always)."""
    return tuple(i for i, k in enumerate(layout.kinds) if k in GROWN_KINDS)


@dataclass(slots=True)
class DecodeBatch:
    """The last step's padded batch, kept for the next one: while the same requests decode and
    nobody else touched their state, the next step appends to it without gathering again (a
    join, a leave, a crop or a restore changes a layer's tensor identity: then it is rebuilt)."""

    states: list[DynamicCache]  # row order
    cache: DynamicCache  # [rows, heads, width, dim] per grown layer, rows right-aligned
    lengths: list[int]  # real positions per row (the rest of ``width`` is left padding)
    grown: tuple[int, ...]  # the layers that are ours (GrowingLayer); the others are shared
    views: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per row, per grown layer
    stacked: tuple[int, ...] = ()  # sliding / linear layers of several rows (batch_stacked)
    stacked_views: list[list[tuple[Any, ...]]] | None = None  # per row, per stacked layer

    def covers(self, states: Sequence[DynamicCache]) -> bool:
        return (
            len(states) == len(self.states)
            and all(a is b for a, b in zip(states, self.states, strict=True))
            and all(
                state.layers[j].keys is k and state.layers[j].values is v
                for state, row in zip(states, self.views, strict=True)
                for j, (k, v) in zip(self.grown, row, strict=True)
            )
            and all(
                self.cache.layers[j] is states[0].layers[j]
                for j in range(len(self.cache.layers))
                if j not in self.grown and j not in self.stacked
            )
            and (
                not self.stacked
                or self.stacked_views is not None
                and all(
                    all(a is b for a, b in zip(held(state.layers[j]), views, strict=True))
                    for state, row in zip(states, self.stacked_views, strict=True)
                    for j, views in zip(self.stacked, row, strict=True)
                )
            )
        )


def gather(model: Any, states: Sequence[DynamicCache], grown: tuple[int, ...]) -> DecodeBatch:
    """Copy every request's keys/values of the ``grown`` layers right-aligned into one padded
    batch cache, and stack the other stateful layers of several rows (``batch_stacked``); a
    stateless layer, or any layer of a single request, is the request's own object."""
    lengths = [state_length(s, grown) for s in states]
    longest, rows = max(lengths), len(states)
    batch = DynamicCache(config=model.config)
    stacked = []
    for j in range(len(batch.layers)):
        kind = type(states[0].layers[j]).__name__
        if j not in grown and (rows == 1 or kind not in (SLIDING, LINEAR)):
            batch.layers[j] = states[0].layers[j]
            continue
        if j not in grown:
            batch.layers[j] = stack_layers([s.layers[j] for s in states], lengths, longest)
            stacked.append(j)
            continue
        parts = [s.layers[j] for s in states]
        k0, v0 = parts[0].keys, parts[0].values
        room = longest + GrowingLayer.ROOM
        # the left padding is zeroed too: masked, and finite for the same reason as the room
        keys = new_buffer(k0, rows, room, longest)
        values = new_buffer(v0, rows, room, longest)
        for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
            keys[i, :, : longest - n].zero_()
            values[i, :, : longest - n].zero_()
            keys[i, :, longest - n : longest] = part.keys[0]
            values[i, :, longest - n : longest] = part.values[0]
        if kind == HYBRID:  # keys grown, conv/recurrent states stacked as a linear layer's
            layer: GrowingLayer = GrowingHybridLayer(parts[0].number_of_states)
            fill_linear(layer, parts, longest)
            stacked.append(j)
        else:
            layer = GrowingLayer()
        layer.fill(keys, values, longest)
        batch.layers[j] = layer  # our own cache object: its layers are ours to choose
    return DecodeBatch(list(states), batch, lengths, grown, [], tuple(stacked))


def state_length(state: DynamicCache, grown: tuple[int, ...]) -> int:
    """A request's positions: its full-attention layers' (``grown``) length, else the count of
    its sliding or linear layers."""
    if grown:
        return int(state.layers[grown[0]].get_seq_length())
    kinds = (SLIDING, LINEAR)
    return row_length(next(x for x in state.layers if type(x).__name__ in kinds))


def _device(cache: DynamicCache) -> torch.device:
    return next(t.device for x in cache.layers for t in held(x) if isinstance(t, torch.Tensor))


def batched_decode(
    model: Any,
    cache_arg: str,
    states: Sequence[DynamicCache],
    tokens: Sequence[int],
    last: DecodeBatch | None,
    step: Callable[..., Any] | None = None,
    positions: Callable[[list[int]], torch.Tensor] | None = None,
    grown: tuple[int, ...] | None = None,
) -> tuple[list[torch.Tensor], DecodeBatch]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward (``can_batch``
    layouts): each row's logits, and the batch to pass back as ``last`` next step. ``step``:
    a compiled forward (static shapes; every layer full attention), None for the model itself.
    ``positions``: the rows' ``position_ids`` from their real lengths (a 3-D RoPE model's,
    ``torch.mrope``); default the lengths. ``grown``: the full-attention layers (default
    every layer); the others are sliding windows, linear-attention state or stateless. A
    layout of linear layers only (mamba) has no positions: no mask, no ``position_ids``."""
    grown = tuple(range(len(states[0].layers))) if grown is None else grown
    batch = last if last is not None and last.covers(states) else gather(model, states, grown)
    lengths, rows = batch.lengths, len(states)
    width = max(lengths)  # the longest row has no padding
    device = _device(batch.cache)
    ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=device)
    kwargs: dict[str, Any] = {}
    if any(isinstance(x, DynamicLayer) for x in batch.cache.layers):  # attention: positions
        kwargs["position_ids"] = (
            torch.tensor([[n] for n in lengths], dtype=torch.long, device=device)
            if positions is None
            else positions(lengths)
        )
    if step is None:
        # the mask covers the cached positions and the new one; padding is the left part of a
        # row (a lone row has none: no mask)
        if rows > 1 and "position_ids" in kwargs:
            mask = torch.zeros((rows, width + 1), dtype=torch.long, device=device)
            for i, n in enumerate(lengths):
                mask[i, width - n :] = 1
            kwargs["attention_mask"] = mask
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                    **{cache_arg: batch.cache}, **kwargs)  # fmt: skip
    else:
        out = _static_step(step, model, cache_arg, batch, ids, kwargs["position_ids"], width)
    # each request's layers become views of its row (the padding cut off): no copy back
    batch.lengths = [n + 1 for n in lengths]
    _hand_out_views(batch, width)
    return [out.logits[i, -1] for i in range(rows)], batch


def lone_decode(
    model: Any,
    cache_arg: str,
    state: DynamicCache,
    token: int,
    last: DecodeBatch | None,
    grown: tuple[int, ...],
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DecodeBatch]:
    """One request's next token on any layout with full-attention layers (``grown``, not
    empty): those append in place, every other layer is its own object, updated by the model as in a plain forward
    (a sliding ring or an SSM state does not grow). No mask: one row has no padding.
    ``position_ids``: a 3-D RoPE model's (``torch.mrope``), else the row's length."""
    batch = last if last is not None and last.covers([state]) else gather(model, [state], grown)
    width = batch.lengths[0]
    device = _device(batch.cache)
    if position_ids is None:
        position_ids = torch.tensor([[width]], dtype=torch.long, device=device)
    kwargs = {"position_ids": position_ids}
    out = model(input_ids=torch.tensor([[token]], dtype=torch.long, device=device),
                use_cache=True, logits_to_keep=1, **{cache_arg: batch.cache}, **kwargs)  # fmt: skip
    batch.lengths = [width + 1]
    _hand_out_views(batch, width)
    return out.logits[0, -1], batch


def _hand_out_views(batch: DecodeBatch, width: int) -> None:
    batch.views = []
    if batch.stacked:
        by_layer = [
            hand_out_rows(batch.cache.layers[j], batch.states, j, batch.lengths)
            for j in batch.stacked
        ]
        batch.stacked_views = [list(row) for row in zip(*by_layer, strict=True)]
    for i, state in enumerate(batch.states):
        start = width + 1 - batch.lengths[i]  # the row's first real position; new token last
        row = []
        for j in batch.grown:
            layer = batch.cache.layers[j]
            k = layer.keys[i : i + 1, :, start:]
            v = layer.values[i : i + 1, :, start:]
            state.layers[j].keys, state.layers[j].values = k, v
            row.append((k, v))
        batch.views.append(row)


def _static_step(
    step: Callable[..., Any],
    model: Any,
    cache_arg: str,
    batch: DecodeBatch,
    ids: torch.Tensor,
    positions: torch.Tensor,
    width: int,
) -> Any:
    """The forward with static shapes: every layer's whole buffer, the new token at ``width``."""
    layers = [batch.cache.layers[j] for j in batch.grown]
    for layer in layers:
        layer.reserve(width + 1)
    kbuf = layers[0]._bufs[0]
    rows, cap = kbuf.shape[0], kbuf.shape[2]
    visible = torch.zeros((rows, 1, 1, cap), dtype=torch.bool, device=kbuf.device)
    for i, n in enumerate(batch.lengths):
        visible[i, 0, 0, width - n : width + 1] = True
    mask = mask_for(model, visible, kbuf.dtype)
    at = torch.tensor([width], dtype=torch.long, device=kbuf.device)
    for layer in layers:
        layer.at = at
    try:
        out = step(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   logits_to_keep=1, **{cache_arg: batch.cache})  # fmt: skip
    finally:
        for layer in layers:
            layer.at = None
            kb, vb = layer._bufs
            layer.keys, layer.values = kb[:, :, : width + 1], vb[:, :, : width + 1]
    return out


def mask_for(model: Any, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A prepared 4-D mask (transformers passes one through as it is): booleans for sdpa, an
    additive float mask for the eager attention."""
    if model.config._attn_implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )
