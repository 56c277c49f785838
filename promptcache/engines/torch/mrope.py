"""3-D ("mRoPE") positions of the Qwen-VL class on transformers, per request state.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE) and GLM-4V(-MoE) give an image's tokens (temporal, height,
width) positions from its grid and shift the text after it: a text token's position is its index
plus the offset the images before it left. transformers keeps that offset on the model
(``rope_deltas``: one for all requests, set by whichever prefill ran last); here each request
state has its own, and every forward gets explicit ``position_ids`` from the model's public
``get_rope_index``, so a prefill chunk, a prefix restored from the cache (ending anywhere) and a
decode step each get the positions one whole-prompt forward would. Rows are [index, t, h, w]:
the layout transformers' own ``generate`` passes (the first row drives the attention mask).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from promptcache.core.images import ImageInput, ImageSpan

MAX_TABLES = 64  # prompts' position tables kept (a request's chunks reuse its table)


class Table(NamedTuple):
    """Positions of a prompt's tokens up to one past its last image: ``rows`` (3, n); ``ends``:
    (end of image k, the offset of the text after it) in order."""

    rows: torch.Tensor
    ends: tuple[tuple[int, int], ...]


class MropePositions:
    """``position_ids`` for every forward of a Qwen-VL-class model. ``grid_of``: an image's
    (t, h, w) patch grid, as its image processor makes it. Owns each state's image offsets
    (weakly: a state that is dropped takes its entry with it)."""

    def __init__(self, model: Any, grid_of: Callable[[ImageInput], tuple[int, int, int]]) -> None:
        self.inner = model.model  # the *Model under *ForConditionalGeneration: get_rope_index
        self.grid_of = grid_of
        self.device = next(model.parameters()).device
        self._offsets: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], ...]] = (
            weakref.WeakKeyDictionary()
        )
        self._tables: OrderedDict[tuple[Any, ...], Table] = OrderedDict()
        self._lock = threading.Lock()

    def table(self, spans: Sequence[ImageSpan]) -> Table:
        key = tuple((s.start, s.length, s.image.digest) for s in spans)
        with self._lock:
            found = self._tables.get(key)
            if found is not None:
                self._tables.move_to_end(key)
                return found
        n = spans[-1].end + 1  # one text position past the last image: its offset
        types = torch.zeros((1, n), dtype=torch.int)
        for s in spans:
            types[0, s.start : s.end] = 1
        grids = torch.tensor([list(self.grid_of(s.image)) for s in spans], dtype=torch.long)
        rows, _ = self.inner.get_rope_index(
            torch.zeros((1, n), dtype=torch.long), mm_token_type_ids=types, image_grid_thw=grids
        )
        rows = rows[:, 0].to(torch.long)
        ends = tuple((s.end, int(rows[0, s.end]) - s.end) for s in spans)
        found = Table(rows, ends)
        with self._lock:
            self._tables[key] = found
            while len(self._tables) > MAX_TABLES:
                self._tables.popitem(last=False)
        return found

    def chunk(
        self, state: Any, start: int, length: int, spans: Sequence[ImageSpan]
    ) -> torch.Tensor:
        """(4, 1, length) positions of prompt tokens [start, start + length) of a prompt with
        images ``spans``; ``state`` then carries their offsets for the text and decode after."""
        table = self.table(spans)
        self._offsets[state] = table.ends
        index = torch.arange(start, start + length)
        known = table.rows.shape[1]
        rows = index.expand(3, -1) + table.ends[-1][1]  # past the table: the last image's offset
        inside = index < known
        rows[:, inside] = table.rows[:, index[inside]]
        return torch.cat([index[None], rows])[:, None, :].to(self.device)

    def offset(self, state: Any, length: int) -> int:
        """The position offset of text at index ``length`` of ``state``: the last image that
        ends by then decides (0 without images)."""
        out = 0
        for end, off in self._offsets.get(state, ()):
            if end <= length:
                out = off
        return out

    def text(self, state: Any, length: int) -> torch.Tensor:
        """(4, 1, length) positions of text tokens appended to ``state``: after every image."""
        start = state.get_seq_length()
        index = torch.arange(start, start + length)
        shifted = index + self.offset(state, start)
        return torch.cat([index[None], shifted.expand(3, -1)])[:, None, :].to(self.device)

    def decode_rows(self, states: Sequence[Any], lengths: Sequence[int]) -> torch.Tensor:
        """(4, rows, 1) positions of one decode token per state (a padded batch: ``lengths``
        are the rows' real lengths)."""
        index = torch.tensor([[n] for n in lengths], dtype=torch.long)
        offsets = [[self.offset(s, n)] for s, n in zip(states, lengths, strict=True)]
        shifted = index + torch.tensor(offsets, dtype=torch.long)
        return torch.cat([index[None], shifted[None].expand(3, -1, -1)]).to(self.device)

    def crop(self, state: Any, length: int) -> None:
        """``state`` was cut back to ``length`` positions: images past it no longer count."""
        ends = self._offsets.get(state)
        if ends is not None:
            self._offsets[state] = tuple(e for e in ends if e[0] <= length)
