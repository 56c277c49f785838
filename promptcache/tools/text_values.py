"""Arguments written as text, one element per parameter (Qwen XML, GLM): how a parser types a
value back, how render writes it, and the grammar that holds a forced call's values to their
JSON schema.

The grammar writes each value in a form ``typed_value`` reads back as a value the schema
accepts: a string verbatim within ``minLength``/``maxLength``, ``pattern`` (``schema_regex``'s
subset), ``enum`` and ``const``; an integer or number as plain digits within its bounds;
``true``/``false``; ``null``; objects and arrays as JSON under their schema (``%json``). What falls
back to ``%json`` for the whole value: ``anyOf``/``oneOf``/``allOf``/``not``/``$ref`` and
``multipleOf`` (a string among their branches is then written quoted, and read with its quotes);
a pattern outside the subset is logged and left out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .base import dump, json_rule, lark_str, lark_text
from .number_regex import number_regex
from .schema_regex import ANY, literal, string_regex

log = logging.getLogger("promptcache.tools")
_COMPOSED = ("anyOf", "oneOf", "allOf", "not", "$ref", "multipleOf")
# texts typed_value reads as something other than a string (after its strip()): the string form
# of a union type must avoid them
_WS = r"[\s\x{1c}-\x{1f}]*"
_TYPED_LOOK = (
    f"/{_WS}(?:-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|(?i:true|false|null|none)"
    f"|NaN|-?Infinity){_WS}/ | /{_WS}[\\[{{](?s:.*)/"
)
_warned: set[str] = set()


def param_schema(tools: list[dict] | None, name: str, key: str) -> dict | None:
    """The JSON schema of parameter ``key`` of tool ``name``, or None when not declared."""
    for t in tools or []:
        func = t.get("function", t)
        if func.get("name") == name:
            props = (func.get("parameters") or {}).get("properties") or {}
            prop = props.get(key)
            return prop if isinstance(prop, dict) else None
    return None


def _types(schema: dict | None) -> set[str]:
    kind = (schema or {}).get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if schema and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    return set()


def typed_value(raw: str, schema: dict | None) -> Any:
    """A parameter value written as text, typed by its schema: strings verbatim; numbers,
    booleans, null, objects and arrays parsed (as JSON, else as the text when they do not
    parse). Without a schema: JSON when the text is a JSON number, boolean, null, object or
    array, else the string."""
    types = _types(schema)
    if types == {"string"}:
        return raw
    text = raw.strip()
    if types & {"boolean"} and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"null"} and text.lower() in ("null", "none"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return raw
    if isinstance(value, str):  # a JSON-quoted string where a string is allowed: the text
        return raw
    if isinstance(value, float) and value.is_integer() and "integer" in types:
        return int(value)
    return value


def text_value(value: Any) -> str:
    """How text-argument formats write a value: strings as is, everything else as JSON."""
    return value if isinstance(value, str) else dump(value)


def value_forms(schema: dict) -> tuple[list[str], list[dict]]:
    """How a value under ``schema`` may be written: Lark regex expressions for the plain-text
    forms (each reads back through typed_value as a valid value) and JSON schemas for the forms
    written as JSON."""
    if any(k in schema for k in _COMPOSED):
        return [], [schema]
    choices = _choices(schema)
    if choices is not None:
        forms = []
        for value in choices:
            text = text_value(value)
            back = typed_value(text, schema)
            if isinstance(back, str) == isinstance(value, str) and dump(back) == dump(value):
                form = f"/(?:{literal(text)})/"  # (?:) for "": an empty /-/ is no Lark
                forms.append(f"{form} & {_string(schema)}" if isinstance(value, str) else form)
        return (forms, []) if forms else ([], [schema])
    types = _types(schema)
    regexes, schemas = [], []
    for kind in sorted(types):
        if kind == "string":
            form = _string(schema)
            regexes.append(form if types == {"string"} else f"({form}) & ~({_TYPED_LOOK})")
        elif kind in ("integer", "number"):
            regexes.append(f"/{number_regex(schema, kind == 'integer')}/")
        elif kind == "boolean":
            regexes.append("/true|false/")
        elif kind == "null":
            regexes.append("/null/")
        else:  # objects and arrays: JSON
            schemas.append({**schema, "type": kind})
    if not regexes and not schemas:  # no type: any JSON value
        schemas.append(schema)
    return regexes, schemas


def _choices(schema: dict) -> list[Any] | None:
    """The values ``enum`` and ``const`` allow, or None when the schema names none."""
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        const = schema["const"]
        choices = [const] if choices is None or const in choices else []
    return choices


def _string(schema: dict) -> str:
    expr, translated = string_regex(schema)
    if not translated and schema["pattern"] not in _warned and len(_warned) < 256:
        _warned.add(schema["pattern"])
        log.warning("pattern %r is beyond the regex subset forced text values follow: "
                    "those values are not held to it", schema["pattern"])  # fmt: skip
    return expr


def _split_close(close: str, special: Mapping[str, int] | None) -> tuple[str, str]:
    """(the text of ``close`` before its first special-token marker, the rest)."""
    found = [close.find(m) for m in special or () if m in close]
    cut = min(found) if found else len(close)
    return close[:cut], close[cut:]


def value_rules(
    name: str, schema: dict, close: str, special: Mapping[str, int] | None
) -> tuple[list[str], str]:
    """Rules for one value then ``close``, and the Lark expression that uses them. A plain-text
    value and the text of ``close`` up to a special token are one terminal (so the lexer never
    has to guess where a string that may hold newlines ends), which cannot hold the closer."""
    lead, rest = _split_close(close, special)
    marker = literal(close.strip())
    regexes, schemas = value_forms(schema)
    rules, options = [], []
    if regexes:
        forms = " | ".join(f"({r})" for r in regexes)
        term = f"(({forms}) & ~/{ANY}{marker}{ANY}/)"
        rules.append(f"V_{name}: {term} {lark_str(lead)}" if lead else f"V_{name}: {term}")
        options.append(
            " ".join(x for x in (f"V_{name}", lark_text(rest, special) if rest else "") if x)
        )
    for k, sub in enumerate(schemas):
        rules.append(f"j_{name}_{k}: {json_rule(sub)}")
        options.append(f"j_{name}_{k} {lark_text(close, special)}")
    return rules, "(" + " | ".join(options) + ")"


def grammar_of_values(
    funcs: list[dict],
    head: Callable[[str], str],
    param: Callable[[str], tuple[str, str, str]],
    tail: str,
    sep: str,
    parallel: bool,
    special: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar for formats that write each parameter as text: per call head(name), then
    per declared parameter (in schema order; optional ones may be left out) open + value +
    close + after where param(key) = (open, close, after), then tail. Each value in a form
    value_forms allows. A tool whose schema declares no properties takes any parameter names,
    with string values."""

    def text(s: str) -> str:
        return lark_text(s, special) if s else ""

    def seq(*items: str) -> str:
        return " ".join(x for x in items if x)

    alts, rules = [], []
    for i, func in enumerate(funcs):
        schema = func.get("parameters") or {"type": "object"}
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        items = []
        for j, (key, prop) in enumerate(props.items()):
            opening, close, after = param(key)
            prop = prop if isinstance(prop, dict) else {}
            if "x-guidance" in schema:  # JSON values written as the whole call's JSON is
                prop = {**prop, "x-guidance": schema["x-guidance"]}
            value, body = value_rules(f"{i}_{j}", prop, close, special)
            rules += [*value, f"p_{i}_{j}: {seq(text(opening), body, text(after))}"]
            items.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        if not props and schema.get("additionalProperties", True) is not False:
            opening, close, after = param("\x00")
            before_key, after_key = opening.split("\x00")
            value, body = value_rules(f"{i}", {"type": "string"}, close, special)
            rules += [f"K_{i}: /[A-Za-z_][A-Za-z0-9_.\\-]*/", *value]
            rules.append(
                f"g_{i}: {seq(text(before_key), f'K_{i}', text(after_key), body, text(after))}"
            )
            items.append(f"g_{i}*")
        rules.insert(0, f"call_{i}: {seq(text(head(func['name'])), *items, text(tail))}")
        alts.append(f"call_{i}")
    more = f" ({text(sep)} call)*" if sep else " call*"
    start = "call" + (more if parallel else "")
    return "\n".join([f"start: {start}", "call: " + " | ".join(alts), *rules]) + "\n"
