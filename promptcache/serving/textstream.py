"""Incremental detokenisation with stop strings: emits only text that can no longer change."""

from __future__ import annotations

from collections.abc import Callable


class StopTextStream:
    """Feed token ids one at a time; get back the text that became final.

    Text that could still be the start of a stop string, or an incomplete UTF-8 sequence, is
    held back until it resolves. Once a stop string appears, everything from it on is dropped.
    """

    __slots__ = ("_decode", "_stops", "ids", "text", "_emitted", "stopped", "matched_stop")

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None) -> None:
        self._decode = decode
        self._stops = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # final text so far (excludes held-back text)
        self._emitted = 0
        self.stopped = False
        self.matched_stop: str | None = None

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full = self._decode(self.ids)
        found = [(i, s) for s in self._stops if (i := full.find(s)) >= 0]
        if found:
            cut, self.matched_stop = min(found)
            self.stopped = True
            return self._emit(full[:cut])
        if full.endswith("\ufffd"):  # a multi-byte character still being generated
            return ""
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._emit(full[: len(full) - hold])

    def flush(self) -> str:
        """At the end of generation: release held-back text (it did not become a stop string)."""
        if self.stopped or not self.ids:
            return ""
        return self._emit(self._decode(self.ids))

    def _emit(self, final: str) -> str:
        delta = final[self._emitted :]
        self._emitted = len(final)
        self.text = final
        return delta
