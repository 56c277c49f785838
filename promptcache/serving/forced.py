"""Forced replies: a token constraint that allows exactly one given token sequence.

The scripted test model's seam (``serve --scripted-replies``): the server decides a reply's
token ids before decoding and the engine emits them through the same masking path a grammar
uses, so the prefill, the cache, streaming, stop handling and the final save all run for real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class TokenConstraint(Protocol):
    """What decoding asks of a constraint: ``mask`` the logits before each sample, ``accept``
    each emitted token; ``is_stopped`` ends the reply after the token just accepted."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token_id: int) -> None: ...

    @property
    def is_stopped(self) -> bool: ...


class ForcedTokens:
    """Allows ``ids[i]`` at step i (any sampler then picks it: every other logit is -inf) and
    stops after the last one. The ids should end with an end-of-sequence token when the reply
    is whole, as a model's own reply does."""

    __slots__ = ("_ids", "_pos")

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("a forced reply needs at least one token")
        self._ids = tuple(int(i) for i in ids)
        self._pos = 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A new array: 0 at the next forced token, -inf elsewhere."""
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[self._ids[min(self._pos, len(self._ids) - 1)]] = 0.0
        return out

    def accept(self, token_id: int) -> None:
        self._pos += 1

    @property
    def is_stopped(self) -> bool:
        return self._pos >= len(self._ids)
