"""The context limit, checked in one place: does a prompt fit, and how much room it leaves.

``check_prompt_fits`` is the engine's (every caller of ``generate``/``prefill`` goes through it);
``fit_output`` is the server's policy for a ``max_tokens`` larger than the room left: clamped to
the room (as LM Studio, llama.cpp and Ollama do) or, with ``strict``, refused.
"""

from __future__ import annotations

from typing import NamedTuple

from promptcache.errors import PromptTooLongError, RequestError


class OutputFit(NamedTuple):
    max_tokens: int  # what the reply may have
    clamped_from: int | None = None  # the max_tokens asked for, when it was lowered to the room


def check_prompt_fits(num_prompt: int, max_context: int) -> int:
    """The room left for the reply (>= 1); raises when the prompt is empty or leaves none."""
    if num_prompt == 0:
        raise RequestError("the prompt is empty")
    if num_prompt >= max_context:
        raise PromptTooLongError(
            f"the prompt has {num_prompt} tokens; this server's context is {max_context} tokens",
            num_prompt,
            max_context,
        )
    return max_context - num_prompt


def fit_output(num_prompt: int, max_tokens: int, max_context: int, strict: bool) -> OutputFit:
    """``max_tokens`` within the room the prompt leaves. A prompt that leaves no room is not
    judged here (``check_prompt_fits`` refuses it with its own wording)."""
    room = max_context - num_prompt
    if room <= 0 or max_tokens <= room:
        return OutputFit(max_tokens)
    if strict:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            num_prompt,
            max_context,
            max_tokens=max_tokens,
        )
    return OutputFit(room, max_tokens)
