"""Reasoning in generated text: split it from the answer, whole or while streaming.

A ``ReasoningParser`` splits a reply into (reasoning, rest); the rest goes on to the tool-call
parser. ``split(text, is_open, partial=True)`` is the streaming form: it returns prefixes of
what the whole reply will split into, holding back text that could still change side (a marker
being written, trailing whitespace), so a streamer can send each side's growth as it comes.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from . import harmony

THINK, END_THINK = "<think>", "</think>"


class Reasoned(NamedTuple):
    reasoning: str
    rest: str  # the answer (and any tool-call markup), for the tool-call parser


class ReasoningParser(Protocol):
    name: str  # "think", "harmony", "none"
    markers: tuple[str, ...]  # marker text the parser reads (kept visible when decoding)

    def is_open(self, prompt_text: str) -> bool:
        """Does the rendered prompt end inside a reasoning block (Qwen3.5's generation prompt
        ends with ``<think>\\n``), so the reply starts with reasoning?"""
        ...

    def split(self, text: str, is_open: bool = False, partial: bool = False) -> Reasoned:
        """(reasoning, rest) of a reply. partial: ``text`` is a prefix of the reply; both parts
        are prefixes of those of the whole reply. Never raises."""
        ...

    def grammar_prefix(self, is_open: bool, for_calls: bool) -> str:
        """Text a constrained reply (forced tool call, JSON answer) must start with: closing an
        open reasoning block, or harmony's final channel for an answer."""
        ...


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Where a suffix of text that could be the start of a marker begins (len(text): none)."""
    for cut in range(max(len(text) - max(map(len, markers)) + 1, 0), len(text)):
        if any(m.startswith(text[cut:]) for m in markers):
            return cut
    return len(text)


class NoReasoning:
    name: str = "none"
    markers: tuple[str, ...] = ()

    def is_open(self, prompt_text: str) -> bool:
        return False

    def split(self, text: str, is_open: bool = False, partial: bool = False) -> Reasoned:
        return Reasoned("", text)

    def grammar_prefix(self, is_open: bool, for_calls: bool) -> str:
        return ""


class ThinkReasoning:
    """``<think>...</think>`` before the answer (Qwen3, Qwen3.5/3.6, DeepSeek R1/V3.1, GLM,
    Kimi K2 Thinking, MiniMax): opened in the prompt or at the start of the reply. A reply cut
    before ``</think>`` is all reasoning."""

    name: str = "think"
    markers: tuple[str, ...] = (THINK, END_THINK)

    def is_open(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK)

    def split(self, text: str, is_open: bool = False, partial: bool = False) -> Reasoned:
        body = text.lstrip()
        if not is_open:
            if partial and THINK.startswith(body) and body:  # "<thi" may open a block
                return Reasoned("", "")
            if not body.startswith(THINK):
                return Reasoned("", text)
        body = body.removeprefix(THINK)
        end = body.find(END_THINK)
        if end >= 0:
            return Reasoned(body[:end].strip(), body[end + len(END_THINK) :].lstrip())
        if partial:
            body = body[: _held(body, (END_THINK,))]
        return Reasoned(body.strip(), "")

    def grammar_prefix(self, is_open: bool, for_calls: bool) -> str:
        # an empty block, as Qwen3 templates render one (and enable_thinking=False prompts end)
        return "\n" + END_THINK + "\n\n" if is_open else ""


class HarmonyReasoning:
    """gpt-oss: the analysis channel is the reasoning; final and commentary bodies are the
    answer, and messages to a recipient (tool calls) stay as their harmony text for the tool
    parser. Pieces of each side are joined with a newline."""

    name: str = "harmony"
    markers: tuple[str, ...] = harmony.MARKERS

    def is_open(self, prompt_text: str) -> bool:
        return False

    def split(self, text: str, is_open: bool = False, partial: bool = False) -> Reasoned:
        messages, done = harmony.scan(text)
        reasoning: list[str] = []
        rest: list[str] = []
        first = harmony.header_at(text)
        lead = text[: first if first >= 0 else done]
        if partial and first < 0:  # no header yet: hold what could become one
            lead = lead[: _held(lead, harmony.MARKERS)]
        rest.append(lead.strip())
        for k, m in enumerate(messages):
            body = m.body
            if partial and k == len(messages) - 1 and not m.is_closed:
                body = body[: _held(body, harmony.MARKERS)]
            if m.recipient:  # a call: its harmony text, for the tool parser
                rest.append(text[m.start : m.end])
            elif m.channel == "analysis":
                reasoning.append(body.strip())
            else:
                rest.append(body.strip())
        if done < len(text) and not partial:  # a header never completed: text as it was
            rest.append(text[done:].strip())
        return Reasoned("\n".join(r for r in reasoning if r), "\n".join(r for r in rest if r))

    def grammar_prefix(self, is_open: bool, for_calls: bool) -> str:
        return "" if for_calls else harmony.CHANNEL + "final" + harmony.MESSAGE


_REASONERS = {"none": NoReasoning, "think": ThinkReasoning, "harmony": HarmonyReasoning}
ALIASES = {"qwen3": "think", "deepseek_r1": "think", "glm45": "think", "kimi_k2": "think",
           "gpt_oss": "harmony", "openai": "harmony"}  # fmt: skip


def reasoning_names() -> list[str]:
    return [*_REASONERS, *ALIASES]


def make_reasoning(name: str) -> ReasoningParser:
    try:
        return _REASONERS[ALIASES.get(name, name)]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning format {name!r}; known: {', '.join(reasoning_names())}"
        ) from None


def split_reasoning(text: str, name: str = "think", is_open: bool = False) -> Reasoned:
    """The reasoning and the rest of a whole reply in the named format (see ReasoningParser)."""
    return make_reasoning(name).split(text, is_open)
