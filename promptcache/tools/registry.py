"""Parsers by name, and which tool-call and reasoning formats a model uses.

Detection reads three signals, most specific first: the chat template's own markers (what the
template teaches the model to write), the tokenizer's added tokens (the format's markers are
single tokens in the vocabulary), then the config's model_type. A format is named by the first
rule that matches in FORMAT_RULES' order, not by the first marker found in the text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

from .base import ToolCallParser
from .deepseek import DeepSeekParser
from .glm import GlmParser
from .harmony import HarmonyParser
from .hermes import HermesParser
from .kimi import KimiParser
from .llama3 import Llama3JsonParser
from .mistral import MistralParser
from .qwen_xml import QwenXmlParser

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "mistral_args": lambda: MistralParser(style="args"),
    "qwen3_xml": QwenXmlParser,
    "harmony": HarmonyParser,
    "deepseek_v3": lambda: DeepSeekParser(style="v3"),
    "deepseek_v31": lambda: DeepSeekParser(style="v31"),
    "glm45": GlmParser,
    "kimi_k2": KimiParser,
}
ALIASES = {"qwen3_coder": "qwen3_xml", "gpt_oss": "harmony", "openai": "harmony",
           "glm4_moe": "glm45", "glm47": "glm45", "deepseek_v32": "deepseek_v31"}  # fmt: skip
_USES_TOOLS = re.compile(r"\btools\b")


def parser_names() -> list[str]:
    return [*_PARSERS, *ALIASES]


def make_parser(name: str) -> ToolCallParser:
    try:
        return _PARSERS[ALIASES.get(name, name)]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {name!r}; known: {', '.join(parser_names())}"
        ) from None


class Formats(NamedTuple):
    tool_format: str
    native_tools: bool  # the template has its own tools section
    reasoning: str  # "think", "harmony" or "none"
    why: str  # the signal that decided the tool format (logged at start-up)


# (format, template markers (all must appear), vocabulary tokens (all), model types)
FORMAT_RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>"), ("<|channel|>", "<|constrain|>"), ("gpt_oss",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",), ("<|tool_calls_section_begin|>",),
     ("kimi_k2",)),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "```json"), (), ()),
    ("deepseek_v31", ("<｜tool▁calls▁begin｜>",), ("<｜tool▁calls▁begin｜>",),
     ("deepseek_v3", "deepseek_v32")),
    ("glm45", ("<arg_key>",), ("<arg_key>", "<arg_value>"), ("glm4_moe",)),
    ("qwen3_xml", ("<function=", "<parameter="), (), ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text",
                                                    "qwen3_next")),
    ("mistral_args", ("[TOOL_CALLS]", "[ARGS]"), ("[TOOL_CALLS]", "[ARGS]"), ()),
    ("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]",), ("mistral",)),
    ("mistral", ("[AVAILABLE_TOOLS]",), (), ()),
    ("hermes", ("<tool_call>",), ("<tool_call>",), ()),
    ("llama3_json", ("<|python_tag|>",), (), ()),
    ("llama3_json", ("ipython",), (), ()),
    ("llama3_json", ('"parameters"',), (), ()),
)  # fmt: skip


def detect_formats(
    chat_template: str | None, vocab: Iterable[str] = (), model_type: str = ""
) -> Formats:
    """The tool-call format, whether the template has a tools section, and the reasoning
    format of a model, from its chat template, added-token vocabulary and config model_type.

    A model whose template does not mention ``tools`` gets ("hermes", native_tools=False): the
    server then puts hermes' system_prompt(tools) in the system message, unless its vocabulary
    or model type names a format of its own.
    """
    t = chat_template or ""
    words = set(vocab)
    native = bool(_USES_TOOLS.search(t))
    fmt, why = "", ""
    for signal in ("template", "vocabulary", "model_type"):
        for name, marks, tokens, types in FORMAT_RULES:
            if signal == "template" and native and all(m in t for m in marks):
                fmt, why = name, f"chat template markers {', '.join(marks)}"
            elif signal == "vocabulary" and tokens and all(w in words for w in tokens):
                fmt, why = name, f"tokenizer tokens {', '.join(tokens)}"
            elif signal == "model_type" and model_type in types:
                fmt, why = name, f"model_type {model_type}"
            if fmt:
                break
        if fmt:
            break
    if not fmt:
        fmt, why = "hermes", "no format of its own (hermes in the system prompt)"
        native = False
    if fmt == "harmony" or "<|channel|>" in t and "analysis" in t:
        reasoning = "harmony"
    elif "<think>" in t or "</think>" in words:
        reasoning = "think"
    else:
        reasoning = "none"
    return Formats(fmt, native, reasoning, why)


def detect_format(chat_template: str | None) -> tuple[str, bool]:
    """(format name, whether the template has a native tools section) from a template alone."""
    found = detect_formats(chat_template)
    return found.tool_format, found.native_tools
