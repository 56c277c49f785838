"""Tool calls in generated text: parse, stream, render and constrain, one parser per format."""

from .base import ParsedReply, ToolCall, ToolCallParser
from .hermes import HermesParser
from .llama3 import Llama3JsonParser
from .mistral import MistralParser
from .registry import detect_format, make_parser, parser_names
from .stream import ToolStreamSplitter

__all__ = [
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedReply",
    "ToolCall",
    "ToolCallParser",
    "ToolStreamSplitter",
    "detect_format",
    "make_parser",
    "parser_names",
]
