"""Numbers as llguidance regexes, for tool-call values written as plain text (Qwen XML, GLM).

Numbers are written as plain decimals (no exponent) with at most ``FRACTION_DIGITS`` digits after
the point, within ``minimum``/``maximum`` (exclusive ones too, draft 4's boolean form as well); an
open side is capped at ``MAX_MAGNITUDE``: a subset of the schema's values, always a finite text
(a weak model looping on one digit cannot run a call to ``max_tokens``). Each range is exact:
``Fraction`` arithmetic, one regex alternative per fraction length.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

FRACTION_DIGITS = 3
MAX_MAGNITUDE = 10**12  # where a schema leaves a side open: at most 13 digits, exact in a double


def numeric_bounds(schema: dict[str, Any]) -> tuple[Fraction | None, bool, Fraction | None, bool]:
    """(low, low is exclusive, high, high is exclusive) from the schema's numeric keywords."""

    def num(key: str) -> Fraction | None:
        v = schema.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return Fraction(v)
        return None

    low, high = num("minimum"), num("maximum")
    low_x = high_x = False
    if schema.get("exclusiveMinimum") is True:  # draft 4: a flag on minimum
        low_x = low is not None
    elif (x := num("exclusiveMinimum")) is not None and (low is None or x >= low):
        low, low_x = x, True
    if schema.get("exclusiveMaximum") is True:
        high_x = high is not None
    elif (x := num("exclusiveMaximum")) is not None and (high is None or x <= high):
        high, high_x = x, True
    return low, low_x, high, high_x


def number_regex(schema: dict[str, Any], integer: bool) -> str:
    """A regex for JSON numbers (integers when ``integer``) valid under the schema's bounds,
    written without exponent and with at most FRACTION_DIGITS fraction digits."""
    low_or_none, low_x, high_or_none, high_x = numeric_bounds(schema)
    low = low_or_none
    if low is None:
        low, low_x = min(high_or_none or Fraction(0), Fraction(0)) - MAX_MAGNITUDE, False
    high = high_or_none
    if high is None:
        high, high_x = max(low, Fraction(0)) + MAX_MAGNITUDE, False
    alts: list[str] = []
    for digits in range(1 if integer else FRACTION_DIGITS + 1):
        scale = 10**digits
        a, b = math.ceil(low * scale), math.floor(high * scale)
        a += 1 if low_x and a == low * scale else 0
        b -= 1 if high_x and b == high * scale else 0
        if a <= b:
            alts += _signed(a, b, digits)
    return "(?:" + "|".join(alts) + ")" if alts else "[^\\x{0}-\\x{10FFFF}]"  # none: an empty set


def _signed(a: int, b: int, digits: int) -> list[str]:
    """Alternatives for the decimals N / 10**digits, a <= N <= b, written with ``digits``
    fraction digits (none: an integer)."""
    out = []
    if a < 0:
        out += ["-" + r for r in _fixed_point(max(-b, 1), -a, digits)]
    if b >= 0:
        out += _fixed_point(max(a, 0), b, digits)
    return out


def _fixed_point(a: int, b: int, digits: int) -> list[str]:
    """Texts "I" (digits 0) or "I.F" (F exactly ``digits`` long) with a <= I*10**digits+F <= b,
    0 <= a <= b, I written as JSON writes an integer."""
    if digits == 0:
        return _integers(a, b)
    scale = 10**digits
    (i_a, f_a), (i_b, f_b) = divmod(a, scale), divmod(b, scale)
    point = r"\."
    if i_a == i_b:
        return [f"{i_a}{point}{_width(digits, f_a, f_b)}"]
    out = [f"{i_a}{point}{_width(digits, f_a, scale - 1)}"]
    if i_a + 1 <= i_b - 1:
        out += [f"(?:{'|'.join(_integers(i_a + 1, i_b - 1))}){point}[0-9]{{{digits}}}"]
    out.append(f"{i_b}{point}{_width(digits, 0, f_b)}")
    return out


def _integers(a: int, b: int) -> list[str]:
    """Canonical integer texts (no leading zeros) for a..b, 0 <= a <= b."""
    out = []
    for size in range(len(str(a)), len(str(b)) + 1):
        lo = max(a, 10 ** (size - 1) if size > 1 else 0)
        hi = min(b, 10**size - 1)
        if lo <= hi:
            out.append(_width(size, lo, hi))
    return out


def _width(size: int, lo: int, hi: int) -> str:
    """A regex for the ``size``-digit texts (leading zeros kept) of lo..hi."""
    if size == 0:
        return ""
    a, b = str(lo).zfill(size), str(hi).zfill(size)
    if a == b:
        return a
    rest = size - 1
    if a[1:] == "0" * rest and b[1:] == "9" * rest:  # whole runs of the first digit
        head = a[0] if a[0] == b[0] else f"[{a[0]}-{b[0]}]"
        return head + (f"[0-9]{{{rest}}}" if rest else "")
    if a[0] == b[0]:
        return a[0] + _width(rest, int(a[1:]), int(b[1:]))
    parts = [a[0] + _width(rest, int(a[1:]), 10**rest - 1)]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        middle = f"[{int(a[0]) + 1}-{int(b[0]) - 1}]"
        parts.append(middle + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(b[0] + _width(rest, 0, int(b[1:])))
    return "(?:" + "|".join(parts) + ")"
