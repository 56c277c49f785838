"""The weight layouts a machine chose, kept across processes (``layouts.choose_weight_layouts``).

Timing a class of weights in each format takes a second or two at every start, and where two
formats are within the timing's noise the choice went either way from process to process:
2 of 8 fresh processes on one Xeon chose another format for one class and decoded 1-2% slower
than the other six. Kept, every later process on the machine runs the same layouts, and starts
without timing them.

A decision holds for one machine key (the CPU's model name and core count, the torch threads
timed at, the torch version, the formats allowed) and one weight shape; the file maps key ->
shape -> format. A file that cannot be read is ignored (the classes are timed again) and
replaced atomically, so two processes starting together at worst both time.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("promptcache")

FILE_NAME = "weight_layouts.json"


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
    """Decisions kept in ``path`` for this machine (``key``). ``get`` never raises; ``put``
    writes the whole file again (atomically), logging rather than raising when it cannot."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, shape: tuple[int, ...], formats: tuple[str, ...]) -> str | None:
        """The format kept for ``shape`` when it is one of ``formats``, else None."""
        mine = self._read().get(self.key)
        fmt = mine.get(shape_name(shape)) if isinstance(mine, dict) else None
        return fmt if fmt in formats else None

    def put(self, decided: dict[tuple[int, ...], str]) -> None:
        """Keep ``decided`` (shape -> format) beside what the file holds."""
        data = self._read()
        mine = data.get(self.key)
        mine = dict(mine) if isinstance(mine, dict) else {}
        mine.update({shape_name(s): f for s, f in decided.items()})
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
