"""JSON Schema keywords as llguidance regexes, for tool-call values written as plain text.

Formats such as Qwen XML and GLM write a string argument verbatim (and a number as its digits:
``number_regex``), so the grammar of a forced call cannot use ``%json`` for them: the schema's
bounds become regexes here (``text_values`` puts them together).

``pattern`` (ECMA-262, as JSON Schema writes it) is translated for this subset: literal
characters, ``.``, the escapes ``\\d \\D \\w \\W \\s \\S \\t \\n \\r \\f \\v \\0 \\xHH \\uXXXX`` and
escaped punctuation, character classes (ranges, negation, class escapes), groups (capturing,
``(?:...)``, named ``(?<n>...)``), alternation, the quantifiers ``* + ? {n} {n,} {n,m}`` (lazy ones
too: the same language), and ``^``/``$`` at the ends of the top-level alternatives; a side without
its anchor matches anywhere, as JSON Schema searches. Outside it (lookaround, backreferences,
``\\b \\B``, ``\\p{..}``, ``\\cX``, anchors elsewhere, ``[]``/``[^]``, ``{,n}``) ``translate_pattern`` returns
None and the value is held to the schema's other keywords only.
"""

from __future__ import annotations

import re
from typing import Any

ANY = "(?s:.*)"
_SAFE = re.compile(r"[A-Za-z0-9 ]")
_QUANT = re.compile(r"\{(\d+)(,(\d*))?\}")
_CLASS_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_", "s": r"\s", "D": "[:^digit:]", "W": "[:^word:]",
                  "S": r"\S"}  # fmt: skip
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}


class Unsupported(ValueError):
    """A pattern outside the translated subset."""


def literal(s: str) -> str:
    """A regex matching exactly ``s``: letters, digits and spaces as they are, the rest as
    ``\\x{..}`` (never a metacharacter, and never a ``/`` that would end a Lark regex)."""
    return "".join(c if _SAFE.fullmatch(c) else f"\\x{{{ord(c):x}}}" for c in s)


def translate_pattern(pattern: str) -> str | None:
    """``pattern`` as an llguidance regex matching the whole value, or None outside the subset
    (the module's docstring)."""
    try:
        return _Translator(pattern).run()
    except Unsupported:
        return None


class _Translator:
    def __init__(self, src: str) -> None:
        self.src, self.pos = src, 0

    def run(self) -> str:
        alts = [self.sequence(0)]
        while self.eat("|"):
            alts.append(self.sequence(0))
        if self.pos < len(self.src):  # an unmatched ")"
            raise Unsupported(self.src)
        out = []
        for body, start, end in alts:
            out.append(("" if start else ANY) + body + ("" if end else ANY))
        return "(?:" + "|".join(f"(?:{x})" for x in out) + ")"

    def eat(self, s: str) -> bool:
        if self.src.startswith(s, self.pos):
            self.pos += len(s)
            return True
        return False

    def sequence(self, depth: int) -> tuple[str, bool, bool]:
        parts: list[str] = []
        start = end = False
        while self.pos < len(self.src) and self.src[self.pos] not in "|)":
            c = self.src[self.pos]
            if end:  # only the end of a top-level alternative may follow "$"
                raise Unsupported("text after $")
            if c in "^$":
                if depth or (c == "^" and (parts or start)):
                    raise Unsupported("an anchor inside the pattern")
                start, end = start or c == "^", c == "$"
                self.pos += 1
                continue
            parts.append(self.atom(depth) + self.quantifier())
        return "".join(parts), start, end

    def atom(self, depth: int) -> str:
        c = self.src[self.pos]
        self.pos += 1
        if c == "(":
            if self.eat("?") and not (self.eat(":") or self._named_group()):
                raise Unsupported("lookaround")
            alts = [self.sequence(depth + 1)]
            while self.eat("|"):
                alts.append(self.sequence(depth + 1))
            if not self.eat(")"):
                raise Unsupported("an unclosed group")
            return "(?:" + "|".join(a[0] for a in alts) + ")"
        if c == "[":
            return self.char_class()
        if c == ".":
            return r"[^\n\r\x{2028}\x{2029}]"
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?" or (c == "{" and _QUANT.match(self.src, self.pos - 1)):
            raise Unsupported("nothing to repeat")
        if c == "{" and re.match(r",\d*\}", self.src[self.pos :]):
            raise Unsupported("{,n}: a literal in ECMA-262, a repeat in Python")
        return literal(c)

    def _named_group(self) -> bool:
        m = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>").match(self.src, self.pos)
        if m is None:
            return False
        self.pos = m.end()
        return True

    def quantifier(self) -> str:
        c = self.src[self.pos] if self.pos < len(self.src) else ""
        if c in ("*", "+", "?"):
            self.pos += 1
            out = c
        elif c == "{" and (m := _QUANT.match(self.src, self.pos)):
            low, comma, high = m.group(1), m.group(2), m.group(3)
            if high and int(high) < int(low):
                raise Unsupported("a bad repeat")
            self.pos = m.end()
            out = "{" + low + ("," + high if comma and high else "," if comma else "") + "}"
        else:
            return ""
        self.eat("?")  # a lazy quantifier matches the same texts
        nxt = self.src[self.pos] if self.pos < len(self.src) else ""
        if nxt in ("*", "+", "?") or (nxt == "{" and _QUANT.match(self.src, self.pos)):
            raise Unsupported("a repeated repeat")
        return out

    def escape(self, in_class: bool) -> str:
        if self.pos >= len(self.src):
            raise Unsupported("a trailing backslash")
        e = self.src[self.pos]
        self.pos += 1
        if e in _CLASS_ESCAPES:
            inner = _CLASS_ESCAPES[e]
            return inner if in_class else f"[{inner}]"
        if e in _ESCAPES:
            return literal(_ESCAPES[e])
        if e == "b" and in_class:
            return literal("\b")
        if e == "0" and not self.src[self.pos : self.pos + 1].isdigit():
            return literal("\0")
        if e in "xu":
            size = 2 if e == "x" else 4
            digits = self.src[self.pos : self.pos + size]
            if len(digits) != size or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise Unsupported(f"a bad \\{e} escape")
            self.pos += size
            return literal(chr(int(digits, 16)))
        if e.isalnum() or e == "_":  # \b \B, backreferences, \k \c \p ...
            raise Unsupported(f"\\{e}")
        return literal(e)

    def char_class(self) -> str:
        negate = self.eat("^")
        if self.src.startswith("]", self.pos):
            raise Unsupported("an empty class")
        items: list[str] = []
        while not self.eat("]"):
            if self.pos >= len(self.src):
                raise Unsupported("an unclosed class")
            first, is_char = self.class_item()
            if is_char and self.src[self.pos : self.pos + 2] not in ("-]", "-") and self.eat("-"):
                last, last_char = self.class_item()
                if not last_char or ord(last) < ord(first):
                    raise Unsupported("a bad range")
                items.append(f"{literal(first)}-{literal(last)}")
                continue
            items.append(literal(first) if is_char else first)
        return "[" + ("^" if negate else "") + "".join(items) + "]"

    def class_item(self) -> tuple[str, bool]:
        """(a character, True) or (a class escape's regex, False)."""
        c = self.src[self.pos]
        self.pos += 1
        if c != "\\":
            return c, True
        if self.pos < len(self.src) and self.src[self.pos] in _CLASS_ESCAPES:
            return self.escape(in_class=True), False
        rx = self.escape(in_class=True)
        return _unliteral(rx), True


def _unliteral(rx: str) -> str:
    """The one character a ``literal`` regex matches."""
    m = re.fullmatch(r"\\x\{([0-9a-f]+)\}", rx)
    return chr(int(m.group(1), 16)) if m else rx


def string_regex(schema: dict[str, Any]) -> tuple[str, bool]:
    """A Lark regex expression for a string's text under ``minLength``, ``maxLength`` and
    ``pattern``, and whether the pattern (if any) was translated."""
    parts = []
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= 0 else None
    if low or high is not None:
        parts.append(f"/(?s:.{{{low},{'' if high is None else high}}})/")
    pattern = schema.get("pattern")
    translated = True
    if isinstance(pattern, str):
        rx = translate_pattern(pattern)
        translated = rx is not None
        if rx is not None:
            parts.append(f"/{rx}/")
    return (" & ".join(parts) if parts else f"/{ANY}/"), translated
