"""JSON schemas narrowed for decoding, so that every number a forced call writes is finite text.

A JSON number under an open bound (or any ``number``'s fraction) may run on digit after digit: a
weak model at temperature 0 can loop on one digit until ``max_tokens`` and the call never
closes. For the grammar (never for validation) each ``integer``/``number`` schema gets the open
side of its range capped at ``MAX_MAGNITUDE`` and a ``number`` without ``multipleOf`` gets
``multipleOf`` 10**-FRACTION_DIGITS (where its range holds such a value): a subset of the values
the schema allows, as the text formats' ``schema_regex.number_regex`` writes them.
"""

from __future__ import annotations

import math
from typing import Any

from .number_regex import FRACTION_DIGITS, MAX_MAGNITUDE, numeric_bounds

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def finite_numbers(schema: Any) -> Any:
    """``schema`` with every number in it bounded to finite text (a new dict; no side effect)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [finite_numbers(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: finite_numbers(s) for k, s in out[key].items()}
    for key in _SCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            sub = out[key]
            out[key] = (
                [finite_numbers(s) for s in sub] if isinstance(sub, list) else finite_numbers(sub)
            )
    kind = out.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if kinds & {"integer", "number"} and "enum" not in out and "const" not in out:
        _cap(out, "number" in kinds)
    return out


def _cap(schema: dict, fractional: bool) -> None:
    low, low_x, high, high_x = numeric_bounds(schema)
    if low is None:
        schema["minimum"] = int(min(high if high is not None else 0, 0)) - MAX_MAGNITUDE
    if high is None:
        schema["maximum"] = int(max(low if low is not None else 0, 0)) + MAX_MAGNITUDE
    if not fractional or "multipleOf" in schema:
        return
    low, low_x, high, high_x = numeric_bounds(schema)
    assert low is not None and high is not None
    scale = 10**FRACTION_DIGITS
    first, last = math.ceil(low * scale), math.floor(high * scale)
    first += 1 if low_x and first == low * scale else 0
    last -= 1 if high_x and last == high * scale else 0
    if first <= last:
        schema["multipleOf"] = 10**-FRACTION_DIGITS
