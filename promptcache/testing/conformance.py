"""The architecture conformance check: a multi-turn chat on a cached and an uncached engine.

Four turns, each the whole history as a ChatML prompt, then a fifth whose history edits the
fourth reply halfway. Every reply is greedy on both engines; the cached one must produce the
same tokens and reuse what its layer kinds allow (``check_reuse``). Used by
``tests/test_architectures.py`` and ``benchmarks/conformance_table.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from promptcache.engines.base import SamplingParams

USER_TURNS = (
    "You are a helpful assistant. Answer the user's question about flights.",
    "def add(a, b): return a + b. A prompt cache keeps the state it computed.",
    "The quick brown fox jumps over the lazy dog, then books a refund.",
    "search_flights(origin='SFO', destination='JFK') and the bookings.",
    "One more question about the refunds, please.",
)


class Turn(NamedTuple):
    turn: int  # 1-based; the last one is the edited turn
    prompt_tokens: int
    cached_tokens: int
    expected_min: int  # reuse the layer kinds allow at least
    expected_max: int  # and at most (the whole prompt but its last token, or the edit point)
    is_equal: bool  # greedy reply identical to the uncached engine's
    is_edited: bool


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def run_conversation(
    cached: Any, plain: Any, tokenizer: Any, *, max_tokens: int = 8, num_turns: int = 4
) -> list[Turn]:
    """``num_turns`` turns plus the edited one on both engines (same model, ``cached`` with
    its prompt cache, ``plain`` without): one ``Turn`` per turn."""
    params = SamplingParams(max_tokens=max_tokens)
    snapshot = cached.layout.requires_checkpoint
    history = _ids(
        tokenizer, f"<|im_start|>user\n{USER_TURNS[0]}<|im_end|>\n<|im_start|>assistant\n"
    )
    prev_end = 0  # previous prompt + reply: saved by the final save, so the next turn hits it
    turns: list[Turn] = []
    prompt: list[int] = []
    reply: list[int] = []
    for turn in range(num_turns + 1):
        is_edited = turn == num_turns
        low, high = prev_end, len(history) - 1
        if is_edited:  # the previous reply edited from its middle on
            edit = len(prompt) + max(1, len(reply) // 2)
            history = (
                history[:edit] + _ids(tokenizer, " (edited)") + history[len(prompt) + len(reply) :]
            )
            # positional layers reuse up to the edit; snapshot ones the last checkpoint before it
            low, high = (len(prompt) if snapshot else edit), edit
        a = list(cached.generate(history, params))
        b = list(plain.generate(history, params))
        got, want = a[-1].completion_ids, b[-1].completion_ids
        turns.append(
            Turn(turn + 1, len(history), a[0].cached_tokens, low, high, got == want, is_edited)
        )
        prompt, reply = history, want
        prev_end = len(history) + len(reply)
        nxt = USER_TURNS[(turn + 1) % len(USER_TURNS)]
        history = [*history, *reply, *_ids(tokenizer, f"<|im_end|>\n<|im_start|>user\n{nxt}<|im_end|>\n<|im_start|>assistant\n")]  # fmt: skip
    return turns


def reuse_ok(t: Turn) -> bool:
    """Turn 1 reuses nothing (a cold cache); later ones within [expected_min, expected_max]."""
    if t.turn == 1:
        return t.cached_tokens == 0
    return t.expected_min <= t.cached_tokens <= t.expected_max


def format_row(label: str, turns: list[Turn]) -> str:
    """``label | c/p per turn | equal x/n | edited c/p``: the conformance table's row."""
    plain = [t for t in turns if not t.is_edited]
    edited = [t for t in turns if t.is_edited]
    cells = " ".join(f"{t.cached_tokens}/{t.prompt_tokens}" for t in plain)
    equal = sum(t.is_equal for t in plain)
    ed = " ".join(
        f"{t.cached_tokens}/{t.prompt_tokens} {'equal' if t.is_equal else 'DIFFERS'}"
        for t in edited
    )
    ok = all(t.is_equal and reuse_ok(t) for t in turns)
    return f"| {label} | {cells} | {equal}/{len(plain)} | {ed} | {'ok' if ok else 'FAIL'} |"
