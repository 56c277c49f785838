"""Ragged decode: many requests' next tokens in one lean forward, each row attending over its
own keys/values where they are (no padded batch), and the layers that make that cheap.

A padded batch (``batch.py``) copies every row's keys/values into one tensor whenever a request
joins or leaves; under many sessions at once rows change every step or two and that copy, of
every live context, is most of the step. Here each request's full-attention layers are
``RowLayer``s, growing in place in buffers of their own: the projections, norms and MLP run
over all rows at once and only the attention is per row: every decode row in one call of the
``rows_kernel`` (each over its own buffer), or one SDPA call a row where that kernel is not
built. Nothing is gathered; a prefill piece appends in place too (``DynamicLayer``
concatenates: a copy of the whole context per forward).

``packed_forward`` goes further: several requests' prefill pieces and decode tokens side by side
in one forward (one row of all their new tokens), so the weights are read once for all of them
instead of once per request; each request's tokens attend over its own layers, causally among
themselves.

Only the lean step (``lean.LeanDecoder``) runs these: it owns the attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from promptcache.engines.torch import rows_kernel
from promptcache.engines.torch.buffers import POOL
from promptcache.engines.torch.lean import LeanDecoder, LeanLayer, attend_one
from promptcache.engines.torch.state import LAYERS, Segments, TorchLayer, gather_positions

ROOM = 128  # positions allocated ahead of a row (a reallocation every ROOM decode steps)


class RowLayer(DynamicLayer):
    """A request's own full-attention layer that appends in place: ``keys``/``values`` are views
    of buffers with room ahead, so a prefill piece or a decode token is one write, not a copy
    of the whole context (``DynamicLayer`` concatenates), and a request starts decoding without
    being copied into a batch. Positions below the length are never written again (views of
    them may be held elsewhere): when ``keys``/``values`` are no longer the views this layer
    handed out (a crop, a restore, a compaction, a padded batch's row), the next update copies
    what they hold into a fresh buffer first."""

    keys: Any  # DynamicLayer's (set by it, unannotated there)
    values: Any

    def __init__(self, num_positions: int = 0) -> None:
        super().__init__()
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        # positions known to come (the prompt): the first buffer holds them and ROOM more,
        # so a prompt's later pieces append without moving what earlier ones wrote
        self.num_positions = num_positions

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self.get_seq_length(), key_states.shape[-2]
        if self._bufs is None or not self.is_own():
            cap = max(n + new, self.num_positions) + ROOM  # adopt what it holds (one copy)
            self._bufs = (
                _moved(self.keys, key_states, n, cap),
                _moved(self.values, value_states, n, cap),
            )
        elif n + new > self._bufs[0].shape[2]:
            cap = n + new + max(ROOM, n // 4)  # geometric: a long prefill copies O(log) times
            self._bufs = (_moved(self._bufs[0], key_states, n, cap),
                          _moved(self._bufs[1], value_states, n, cap))  # fmt: skip
        kbuf, vbuf = self._bufs
        kbuf[:, :, n : n + new] = key_states
        vbuf[:, :, n : n + new] = value_states
        self.keys, self.values = kbuf[:, :, : n + new], vbuf[:, :, : n + new]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def is_own(self) -> bool:
        """True when ``keys``/``values`` are the views of this layer's own buffers it handed
        out (not a crop, a restore's replacement or a padded batch's row)."""
        views = self._views
        return views is not None and self.keys is views[0] and self.values is views[1]

    def drop_buffers(self) -> None:
        """Let go of the buffers (once keys/values no longer view them: a compaction); the
        next update adopts what the layer then holds."""
        self._bufs = self._views = None

    def fill(self, keys: Segments, values: Segments, device: Any) -> None:
        """Hold a hit's positions (a fresh layer): copied once into buffers with room for
        ``num_positions`` and ROOM more, so the rest of the prompt appends in place."""
        n = sum(used for _, used in keys)
        cap = max(n, self.num_positions) + ROOM
        self._bufs = (gather_positions(keys, device, cap), gather_positions(values, device, cap))
        kbuf, vbuf = self._bufs
        self.lazy_initialization(kbuf, vbuf)
        self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]
        self._views = (self.keys, self.values)


@dataclass(frozen=True, slots=True)
class RowAdapter(TorchLayer):
    """A ``RowLayer`` is stored and cropped as a ``DynamicLayer`` is; a hit is restored into
    its buffers directly."""

    def set_keys_values(self, layer: Any, keys: Segments, values: Segments, device: Any) -> None:
        layer.fill(keys, values, device)


LAYERS.register(RowLayer, RowAdapter(positional=True, snapshot=False))


def _moved(old: torch.Tensor, like: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    """A buffer of ``capacity`` positions holding ``old``'s first ``used`` (the rest is written
    before it is read)."""
    out = POOL.empty_like(like, (like.shape[0], like.shape[1], capacity, like.shape[3]))
    if used:
        out[:, :, :used] = old[:, :, :used]
    return out


def use_row_layers(state: DynamicCache, num_positions: int = 0) -> DynamicCache:
    """``state`` with each full-attention layer (exactly ``DynamicLayer``) a fresh ``RowLayer``
    sized for ``num_positions`` (call on a new, empty state)."""
    for j, layer in enumerate(state.layers):
        if type(layer) is DynamicLayer:
            state.layers[j] = RowLayer(num_positions)
    return state


@torch.inference_mode()
def ragged_decode(
    decoder: LeanDecoder, states: Sequence[DynamicCache], tokens: Sequence[int]
) -> list[torch.Tensor]:
    """Append ``tokens[i]`` to ``states[i]`` for every i in one forward: each row's logits.
    A full-attention layer is a ``RowLayer`` (appends in place; a plain ``DynamicLayer`` would
    concatenate, correct but a copy); a sliding ring hands back its window with the new token,
    all of it visible."""
    device = states[0].layers[0].keys.device
    ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=device)
    positions = torch.tensor([[s.get_seq_length()] for s in states], device=device)
    gqa = decoder.num_heads != decoder.num_kv_heads
    rows_op = rows_attention(decoder)

    def attend(
        i: int, layer: LeanLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv = [state.layers[i].update(k[r : r + 1], v[r : r + 1]) for r, state in enumerate(states)]
        if rows_op is not None:  # every row in one parallel region (rows_kernel)
            keys, values = zip(*kv, strict=True)
            return rows_op(q[:, :, 0].contiguous(), keys, values, layer.scaling).unsqueeze(2)
        outs = [  # each row over its own positions: no padding
            attend_one(q[r : r + 1], keys, values, layer.scaling, gqa)
            for r, (keys, values) in enumerate(kv)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    logits = decoder.run_layers(ids, positions, attend).logits
    return [logits[r, -1] for r in range(len(states))]


@torch.inference_mode()
def packed_forward(
    decoder: LeanDecoder,
    states: Sequence[DynamicCache],
    ids: Sequence[Sequence[int]],
    device: torch.device,
) -> list[torch.Tensor]:
    """Append ``ids[i]`` (a prefill piece, or one decode token) to ``states[i]`` for every i in
    one forward: each sequence's last-position logits. Projections, norms and MLP run over all
    the tokens at once; attention per sequence over its own layers (a ``RowLayer`` appends in
    place), causal within its new tokens; a sliding layer under its window too."""
    lengths = [len(x) for x in ids]
    if min(lengths) < 1:
        raise ValueError("packed_forward: every sequence needs at least one new token")
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    pasts = [s.get_seq_length() for s in states]
    flat = torch.tensor([[t for x in ids for t in x]], dtype=torch.long, device=device)
    positions = torch.cat(
        [torch.arange(p, p + n, device=device) for p, n in zip(pasts, lengths, strict=True)]
    ).view(1, -1)
    # query j of a piece after p cached positions sees keys 0..p+j: additive masks built once
    # for every layer (a boolean one is turned into this by every attention call)
    dtype = decoder.embed.weight.dtype
    masks = [
        _causal_mask(p, n, dtype, device) if n > 1 and p else None
        for p, n in zip(pasts, lengths, strict=True)
    ]
    # a sliding layer's keys are its window's last positions then the piece: a mask always
    windows = {w: [_window_mask(p, n, w, dtype, device) if n > 1 else None
                   for p, n in zip(pasts, lengths, strict=True)]
               for w in {x.window for x in decoder.layers if x.window}}  # fmt: skip
    gqa = decoder.num_heads != decoder.num_kv_heads
    rows_op = rows_attention(decoder)
    # the decode rows' token indices: their attention runs in one call where the kernel is built
    decoding = [r for r, n in enumerate(lengths) if n == 1] if rows_op is not None else []
    at = torch.tensor([bounds[r] for r in decoding], dtype=torch.long, device=device)

    def attend(
        i: int, layer: LeanLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rows_kv = []
        for r, state in enumerate(states):
            a, b = bounds[r], bounds[r + 1]
            keys, values = state.layers[i].update(k[:, :, a:b], v[:, :, a:b])
            if b - a > 1:
                mask = masks[r] if layer.window is None else windows[layer.window][r]
                out[:, :, a:b] = F.scaled_dot_product_attention(
                    q[:, :, a:b], keys, values, attn_mask=mask,
                    is_causal=mask is None,  # a first piece: keys = its queries
                    scale=layer.scaling, enable_gqa=gqa,
                )  # fmt: skip
            elif rows_op is None:  # a decode row
                out[:, :, a:b] = attend_one(q[:, :, a:b], keys, values, layer.scaling, gqa)
            else:
                rows_kv.append((keys, values))
        if rows_kv:
            keys, values = zip(*rows_kv, strict=True)
            rows_q = q[0].index_select(1, at).transpose(0, 1).contiguous()
            out[0].index_copy_(1, at, rows_op(rows_q, keys, values, layer.scaling).transpose(0, 1))
        return out

    last = torch.tensor(bounds[1:], device=device) - 1
    logits = decoder.run_layers(flat, positions, attend, keep=last).logits
    return [logits[0, r] for r in range(len(states))]


def _causal_mask(past: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    hidden = torch.ones(n, past + n, dtype=torch.bool, device=device).triu(past + 1)
    return torch.zeros(n, past + n, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def _window_mask(
    past: int, n: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Query j of a piece after ``past`` positions over a sliding layer's keys: its last
    min(past, window - 1) positions then the piece's; it sees the ``window`` up to itself."""
    kept = min(past, window - 1)
    keys = torch.arange(past - kept, past + n, device=device)[None, :]  # absolute positions
    queries = torch.arange(past, past + n, device=device)[:, None]
    hidden = (keys > queries) | (keys <= queries - window)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def rows_attention(decoder: LeanDecoder) -> Any:
    """The many-rows decode attention kernel (``rows_kernel``) where it serves this model's
    layers (float32 on a CPU) and is built; else None (one SDPA call per row)."""
    weight = decoder.embed.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return rows_kernel.kernel()
