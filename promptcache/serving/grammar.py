"""Grammar-constrained decoding through llguidance: the tokens a grammar allows, step by step.

llguidance was picked over xgrammar and outlines-core because it works on plain numpy logits (so
torch and MLX share one path), builds its token index lazily from any HF fast tokenizer (no
per-schema precompile: a 24-tool call grammar costs milliseconds), and takes JSON Schema and
Lark grammars with ``%json`` embedded, which tool-call formats need (markers around JSON).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as lln
import numpy as np

from promptcache.errors import EngineError

# JSON written as json.dumps writes it: no free whitespace, so a reply renders back to the same
# text (and tokens) and a weak model cannot spend its budget on blanks; unknown keywords ignored
JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


def styled_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``JSON_STYLE`` as its llguidance options (for ``%json`` in Lark)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar for one JSON value valid under ``schema``, written in ``JSON_STYLE``."""
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(styled_schema(schema))))
    except Exception as exc:
        raise EngineError(f"invalid JSON schema: {exc}") from exc


def check_grammar(grammar: str) -> None:
    """Raises EngineError (a 400) naming what is wrong with ``grammar``."""
    ok, error = _validate(grammar)
    if not ok:
        raise EngineError(f"cannot build the output grammar: {error}")


def _validate(grammar: str) -> tuple[bool, str]:
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except Exception as exc:
        return False, str(exc)
    return (not error), str(error)


def hf_tokenizer_of(tokenizer: Any) -> Any:
    """The HF fast tokenizer behind ``tokenizer`` (mlx-lm wraps one in ``_tokenizer``)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if inner is not None and hasattr(inner, "backend_tokenizer") else tokenizer


def build_ll_tokenizer(tokenizer: Any, eos_ids: set[int]) -> Any:
    """An llguidance tokenizer (about 0.3 s for a 50K vocabulary: build it once per engine)."""
    hf = hf_tokenizer_of(tokenizer)
    if not hasattr(hf, "backend_tokenizer"):
        raise EngineError("constrained decoding needs a Hugging Face fast tokenizer")
    return llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos_ids) or None)


class GrammarConstraint:
    """One request's grammar state. ``mask`` before sampling, ``accept`` every sampled token;
    once the grammar is complete only end-of-sequence tokens are allowed."""

    __slots__ = ("_matcher", "_bitmask")

    def __init__(self, ll_tokenizer: Any, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise EngineError(f"cannot build the output grammar: {self._matcher.get_error()}")
        words = (ll_tokenizer.vocab_size + 31) // 32
        self._bitmask = np.zeros((1, words), dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids at -inf (a new array)."""
        lln.fill_next_token_bitmask(self._matcher, self._bitmask)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").astype(bool)
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        n = min(logits.size, allowed.size)
        keep = allowed[:n]
        out[:n][keep] = logits[:n][keep]
        return out

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and cannot continue: decoding ends here."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None
