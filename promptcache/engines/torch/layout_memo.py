"""The weight layouts a machine chose, kept across processes (``layouts.choose_weight_layouts``).

Timing a class of weights in each format takes a second or two at every start, and where two
formats are within the timing's noise the choice went either way from process to process:
2 of 8 fresh processes on one Xeon chose another format for one class and decoded 1-2% slower
than the other six. So the first ``VOTES`` starts on a machine each time a class and record
their choice, and every later start runs the majority of them untimed: one start timed at a
busy moment does not decide for good.

A vote is for one machine key (the CPU's model name and core count, the torch threads timed
at, the torch version, the formats allowed) and one weight shape; the file maps key -> shape ->
format -> votes. A file that cannot be read is ignored (the classes are timed again) and
replaced atomically, so two processes starting together at worst both time.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("promptcache")

FILE_NAME = "weight_layouts.json"
VOTES = 3  # timed starts per class before their majority is kept untimed


def machine_key(formats: tuple[str, ...]) -> str:
    """What a decision depends on besides the weight's shape, as one string."""
    return "|".join(
        (
            cpu_model(),
            f"cores={os.cpu_count()}",
            f"threads={torch.get_num_threads()}",
            f"torch={torch.__version__}",
            "formats=" + ",".join(formats),
        )
    )


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shape_name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


class LayoutMemo:
    """Votes kept in ``path`` for this machine (``key``). ``get`` never raises; ``put``
    writes the whole file again (atomically), logging rather than raising when it cannot."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self._data = self._read()  # read once for every class's ``get``

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _votes(self, data: dict[str, Any], shape: tuple[int, ...]) -> dict[str, int]:
        mine = data.get(self.key)
        got = mine.get(shape_name(shape)) if isinstance(mine, dict) else None
        if not isinstance(got, dict):
            return {}
        return {f: n for f, n in got.items() if isinstance(n, int) and n > 0}

    def get(self, shape: tuple[int, ...], formats: tuple[str, ...]) -> str | None:
        """The format most of ``VOTES`` timed starts chose for ``shape`` (one of ``formats``),
        or None while fewer have voted (time it, then ``put``)."""
        votes = {f: n for f, n in self._votes(self._data, shape).items() if f in formats}
        if sum(votes.values()) < VOTES:
            return None
        return max(sorted(votes), key=votes.__getitem__)  # a tie: the first by name

    def put(self, decided: dict[tuple[int, ...], str]) -> None:
        """Add one vote per shape for the format timed best (shape -> format), to the file as
        it is now (another process may have voted since it was read)."""
        self._data = data = self._read()
        mine = data.get(self.key)
        mine = dict(mine) if isinstance(mine, dict) else {}
        for shape, fmt in decided.items():
            votes = self._votes(data, shape)
            votes[fmt] = votes.get(fmt, 0) + 1
            mine[shape_name(shape)] = votes
        data[self.key] = mine
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".layouts-")
        except OSError as exc:
            log.warning("could not keep the weight layouts in %s: %s", self.path, exc)
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the weight layouts in %s: %s", self.path, exc)
            Path(tmp).unlink(missing_ok=True)
