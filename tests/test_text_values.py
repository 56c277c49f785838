"""Grammars of text-valued tool calls (Qwen XML, GLM) hold every value to its JSON schema:
string bounds, enum, const, pattern (schema_regex's subset, checked against Python's re), number
bounds (checked against exact arithmetic), unions, nested JSON; JSON formats' numbers are finite
text. Checked with llguidance on a byte-level tokenizer, no model."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_parsers import accepts

from promptcache.tools import ToolCall, make_parser
from promptcache.tools.finite_json import finite_numbers
from promptcache.tools.number_regex import number_regex
from promptcache.tools.schema_regex import translate_pattern

jsonschema = pytest.importorskip("jsonschema")
TEXT_FORMATS = ("qwen3_xml", "glm45")


def grammar_and_render(fmt: str, prop: dict, required: bool = True):
    schema = {"type": "object", "properties": {"v": prop}, "required": ["v"] if required else []}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    p = make_parser(fmt)
    grammar = p.call_grammar(tools, parallel=False)

    def render(value) -> str:
        return p.render("", [ToolCall("f", json.dumps({"v": value}))])

    return grammar, render, lambda text: p.parse(text, tools).calls


@pytest.mark.parametrize("fmt", TEXT_FORMATS)
def test_the_issue_case_a_string_of_max_length_12(fmt):
    grammar, render, _ = grammar_and_render(fmt, {"type": "string", "maxLength": 12})
    assert accepts(grammar, render("Buenos Aires")) and accepts(grammar, render(""))
    assert not accepts(grammar, render("Buenos Aires!"))
    assert accepts(grammar, render("é😀\n<a>" * 2))  # 12 characters, not bytes
    assert not accepts(grammar, render("é😀\n<a>" * 2 + "b"))


CASES = [
    ({"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "a\nb ", "abcd"], ["a", "abcde"]),
    ({"type": "string", "enum": ["Paris", "New York", ""]}, ["Paris", "New York", ""], ["Lima", "Pari"]),
    ({"const": "fixed"}, ["fixed"], ["fixe", "fixed!"]),
    ({"const": 3}, [3], [4, "3x"]),
    ({"enum": ["a", 1, True, None]}, ["a", 1, True, None], ["b", 2, False]),
    ({"type": "string", "pattern": "^[A-Z]{3}$"}, ["ABC", "XYZ"], ["AB", "ABCD", "abc"]),
    ({"type": "string", "pattern": "b+", "maxLength": 4}, ["b", "abba"], ["", "aaa", "abbbb"]),
    ({"type": "integer", "minimum": -3, "maximum": 17}, [-3, 0, 17], [-4, 18, 1.5]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}, [1, 99], [0, 100]),
    ({"type": "number", "minimum": -2.5, "exclusiveMaximum": 10}, [-2.5, 0.125, 9.999, 3],
     [-2.6, 10, 10.5, 1.0625]),  # 1.0625: more fraction digits than the grammar writes
    ({"type": "boolean"}, [True, False], [1, "yes"]),
    ({"type": ["integer", "null"], "minimum": 0, "maximum": 9}, [None, 0, 9], [10, "x"]),
    ({"type": ["string", "integer"], "maxLength": 3}, ["abc", 12345, -1], ["true", "abcd", 1.5]),
    ({"type": "object", "properties": {"k": {"type": "string", "maxLength": 2}}},
     [{"k": "ab"}, {}], [{"k": "abc"}]),
    ({"type": "array", "items": {"type": "integer", "maximum": 5}, "maxItems": 2},
     [[], [5, -1]], [[6], [1, 2, 3]]),
]  # fmt: skip


@pytest.mark.parametrize("fmt", TEXT_FORMATS)
@pytest.mark.parametrize(("prop", "good", "bad"), CASES)
def test_text_values_are_held_to_their_schema(fmt, prop, good, bad):
    grammar, render, parse = grammar_and_render(fmt, prop)
    for value in good:
        jsonschema.validate(value, prop)
        text = render(value)
        assert accepts(grammar, text), (value, text)
        assert parse(text) == [ToolCall("f", json.dumps({"v": value}))]
    for value in bad:
        assert not accepts(grammar, render(value)), value


@pytest.mark.parametrize("fmt", TEXT_FORMATS)
def test_a_value_never_holds_its_closer_and_optional_values_may_be_left_out(fmt):
    closer = "</parameter>" if fmt == "qwen3_xml" else "</arg_value>"
    grammar, render, _ = grammar_and_render(fmt, {"type": "string"}, required=False)
    assert accepts(grammar, render("a</b>c")) and not accepts(grammar, render(f"a{closer}c"))
    assert accepts(grammar, make_parser(fmt).render("", [ToolCall("f", "{}")]))


def check(rx: str, text: str) -> bool:
    return accepts(f"start: /{rx}/", text)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    low=st.one_of(st.none(), st.integers(-300, 300)), width=st.integers(0, 400),
    scale=st.sampled_from([1, 10, 100, 1000]), exclusive=st.booleans(), integer=st.booleans(),
    texts=st.lists(st.tuples(st.integers(-999, 999), st.integers(0, 4)), min_size=8, max_size=8),
)  # fmt: skip
def test_number_regex_is_exactly_the_bounded_decimals(low, width, scale, exclusive, integer, texts):
    schema: dict = {}
    lo = None if low is None else Fraction(low, scale)
    hi = Fraction(width, scale) + (lo or 0)
    if lo is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = float(lo)
    schema["exclusiveMaximum" if exclusive else "maximum"] = float(hi)
    rx = number_regex(schema, integer)
    for n, digits in texts:
        text = (
            str(n)
            if digits == 0
            else f"{'-' if n < 0 else ''}{abs(n) // 10**digits}.{abs(n) % 10**digits:0{digits}d}"
        )
        value = Fraction(text)
        lo_f, hi_f = (None if lo is None else Fraction(float(lo))), Fraction(float(hi))
        inside = (lo_f is None or (value > lo_f if exclusive else value >= lo_f)) and (
            value < hi_f if exclusive else value <= hi_f)  # fmt: skip
        writable = digits == 0 if integer else digits <= 3
        assert check(rx, text) == (inside and writable and text != "-0"), (schema, text)


SUPPORTED = [r"^[A-Z]{3}$", "abc", "^a|b$", r"^(foo|bar)-\d+$", r"^\w+\s\w+$", r"^[^/]+/[^/]+$",
             r"^\(\d{3}\) \d{3}-\d{4}$", "x{2,3}?y", r"^[\d\-]{2}$", r"^(?:0[1-9]|1[0-2])$",
             r"^\u0041\x42[\]\\]$", "^a.c$", "^$", "", "^[-a]$", "^[a-]$", r"^[^\W_]+$", "^{$",
             r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4}$"]  # fmt: skip
UNSUPPORTED = ["(?=a)", r"\bword", r"(a)\1", "^a$b", "[]", r"^\p{L}$", "a**", "^a{,3}$", "(a", "a)"]


@pytest.mark.parametrize("pattern", SUPPORTED)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(text=st.text(alphabet="abcxyzAB019-_/@. ()\\]{}$\n", max_size=8))
def test_translated_patterns_match_as_python_searches(pattern, text):
    rx = translate_pattern(pattern)
    assert rx is not None
    found = re.search(pattern, text) is not None
    got = check(rx, text)
    assert found if got else not found or "\n" in text  # Python's $ also matches before a last \n


@pytest.mark.parametrize("pattern", UNSUPPORTED)
def test_patterns_beyond_the_subset_are_refused(pattern):
    assert translate_pattern(pattern) is None


def test_an_untranslated_pattern_is_logged_and_the_other_bounds_kept(caplog):
    grammar, render, _ = grammar_and_render("qwen3_xml", {"type": "string", "pattern": r"\bx",
                                                          "maxLength": 3})  # fmt: skip
    assert "beyond the regex subset" in caplog.text
    assert accepts(grammar, render("abc")) and not accepts(grammar, render("abcd"))


def test_json_numbers_are_finite_text_for_decoding():
    schema = {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": 5}, "n": {"type": ["number", "null"]},
        "a": {"type": "array", "items": {"type": "number", "exclusiveMaximum": 1}},
        "e": {"type": "number", "enum": [1.25]}}}  # fmt: skip
    out = finite_numbers(schema)
    props = out["properties"]
    assert props["i"] == {"type": "integer", "minimum": 5, "maximum": 10**12 + 5}
    assert props["n"] == {"type": ["number", "null"], "minimum": -(10**12), "maximum": 10**12,
                          "multipleOf": 0.001}  # fmt: skip
    assert props["a"]["items"]["minimum"] == -(10**12) and props["e"] == {
        "type": "number",
        "enum": [1.25],
    }
    assert "maximum" not in schema["properties"]["i"]  # the caller's schema is left alone
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for fmt in ("hermes", "qwen3_xml"):
        p = make_parser(fmt)
        grammar = p.call_grammar(tools)
        assert accepts(grammar, p.render("", [ToolCall("f", '{"i": 7, "a": [0.5]}')]))
        assert not accepts(grammar, p.render("", [ToolCall("f", '{"i": 70000000000000000}')]))
        assert not accepts(grammar, p.render("", [ToolCall("f", '{"a": [0.12345]}')]))


def test_kimi_call_index_is_bounded():
    p = make_parser("kimi_k2")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:{}<|tool_call_argument_begin|>{{}}<|tool_call_end|><|tool_calls_section_end|>"
    assert accepts(p.call_grammar(tools), call.format(12))
    assert not accepts(p.call_grammar(tools), call.format("1" * 7))
