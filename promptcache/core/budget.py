"""Byte budgets: '512MB', '4GiB', '20%' (of available RAM) or a plain number of bytes."""

from __future__ import annotations

import re
from pathlib import Path

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
DEFAULT_RAM_FRACTION = 0.20
MIN_RAM_BUDGET_BYTES = 100 * 10**6


def available_ram_bytes() -> int:
    """Memory this process can still take: the machine's available memory, or less where a
    memory cgroup (a container's ``--memory``) leaves less (``cgroup_room_bytes``)."""
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unsupported platform: assume an 8 GB machine
        free = 8 * 10**9
    room = cgroup_room_bytes()
    return free if room is None else min(free, room)


# a cgroup v1 limit at or above this is "no limit" (the kernel writes a page-rounded 2**63 - 1)
_NO_LIMIT = 1 << 60


def cgroup_room_bytes(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What this process's memory cgroups still allow (the tightest of its group and the
    groups above it: limit less usage, reclaimable file pages aside); None without a limit.
    Reads cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``); a group whose folder
    is not mounted here (a container sees its own group as the root) falls back to the root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2 (unified); in a hybrid setup it has no memory controller
            if not (root / "cgroup.controllers").exists():
                continue
            folders = _folders_up(root, path)
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            folders = _folders_up(root / "memory", path)
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for folder in folders:
            room = _room_in(folder, *names)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _folders_up(base: Path, path: str) -> list[Path]:
    """``base``/``path`` and every folder above it up to ``base``, those that exist."""
    parts = [p for p in path.split("/") if p]
    folders = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [f for f in folders if f.is_dir()]


def _room_in(folder: Path, limit_name: str, usage_name: str, inactive_name: str) -> int | None:
    try:
        text = (folder / limit_name).read_text().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        usage = int((folder / usage_name).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for stat in (folder / "memory.stat").read_text().splitlines():
            key, _, value = stat.partition(" ")
            if key == inactive_name:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(text) - max(0, usage - inactive))


def parse_size(value: int | float | str, *, total_bytes: int | None = None) -> int:
    """Bytes from an int, '1.5GB', '512MiB' or '25%' (of ``total_bytes``, default available RAM).

    Raises ValueError with the offending text for anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return int(value)
    text = value.strip().lower().replace("_", "")
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 < pct <= 100:
            raise ValueError(f"percent must be in (0, 100]: {value!r}")
        base = available_ram_bytes() if total_bytes is None else total_bytes
        return int(base * pct / 100)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {value!r} (try 512MB, 4GiB or 20%)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def default_ram_budget() -> int:
    """20% of available RAM, at least 100 MB."""
    return max(int(available_ram_bytes() * DEFAULT_RAM_FRACTION), MIN_RAM_BUDGET_BYTES)


def format_size(num_bytes: float) -> str:
    """'512 B', '3.2 KiB', '768 MiB', '1.5 GiB': the largest binary unit that leaves >= 1."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"
