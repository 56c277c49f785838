"""Tool calls and reasoning in generated text: parse, stream, render and constrain, one parser
per format."""

from .base import ParsedReply, ToolCall, ToolCallParser
from .deepseek import DeepSeekParser
from .glm import GlmParser
from .harmony import HarmonyParser
from .hermes import HermesParser
from .kimi import KimiParser
from .llama3 import Llama3JsonParser
from .mistral import MistralParser
from .qwen_xml import QwenXmlParser
from .reasoning import Reasoned, ReasoningParser, make_reasoning, reasoning_names, split_reasoning
from .registry import Formats, detect_format, detect_formats, make_parser, parser_names
from .stream import ReplyStreamer, ToolStreamSplitter

__all__ = [
    "DeepSeekParser",
    "Formats",
    "GlmParser",
    "HarmonyParser",
    "HermesParser",
    "KimiParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedReply",
    "QwenXmlParser",
    "Reasoned",
    "ReasoningParser",
    "ReplyStreamer",
    "ToolCall",
    "ToolCallParser",
    "ToolStreamSplitter",
    "detect_format",
    "detect_formats",
    "make_parser",
    "make_reasoning",
    "parser_names",
    "reasoning_names",
    "split_reasoning",
]
