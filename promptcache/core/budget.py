"""Byte budgets: '512MB', '4GiB', '20%' (of available RAM) or a plain number of bytes."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
DEFAULT_RAM_FRACTION = 0.20
MIN_RAM_BUDGET_BYTES = 100 * 10**6


def available_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unsupported platform: assume an 8 GB machine
        return 8 * 10**9


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
