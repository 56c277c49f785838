"""A Mooncake-format trace through the real core (hashing, index, RAM tier
and its eviction policy) with a null engine whose blocks have the right sizes but no data.

Each hash id becomes a deterministic run of T token ids; a request's prompt is its blocks' tokens
cut to ``input_length``. Before a request is served its prompt is looked up; after, it is saved
(with ``--with-output``, followed by ``output_length`` generated tokens), as the server would.
Capacity is in tokens: one token of state accounts one byte. ``promptcache replay``
(``cli/replay.py``) runs it on a trace file; benchmarks and tests call ``replay`` directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from promptcache.core.cache import PromptCache
from promptcache.core.policy import EvictionPolicy

_U1 = np.dtype("u1")


class NullArray:
    """Stands in for a block's tensors: sized by shape x dtype, holds no data."""

    __slots__ = ("shape",)
    dtype = _U1

    def __init__(self, num_tokens: int) -> None:
        self.shape = (num_tokens,)


def null_slicer(start: int, end: int) -> NullArray:
    return NullArray(end - start)


class TraceRequest(NamedTuple):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    # multi-turn records (aiperf's ``session_id`` + ``delay`` format) carry only the new turn:
    # the prompt is every earlier turn of the session, each followed by its reply, then this one
    history: tuple[TraceRequest, ...] = ()
    reply_seed: int = -1  # seeds this turn's reply tokens (>= 0 in multi-turn sessions)


REPLY_SEED_BASE = 1 << 40  # reply seeds of session turns never collide with request indices


def _parse(path: str | Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        d = json.loads(line)
        d["input_length"] = int(d["input_length"])
        d["output_length"] = int(d.get("output_length") or 0)
        d["hash_ids"] = list(d["hash_ids"])
        return d
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{lineno}: not a trace record ({exc})") from None


def read_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Requests in arrival order. Plain Mooncake records are whole prompts, in file order.
    Records with a ``session_id`` are multi-turn sessions (aiperf ``synthesize``): the first
    turn arrives at its ``timestamp`` (ms), each next one ``delay`` ms after the previous, and
    its prompt accumulates the session's history (``TraceRequest.history``)."""
    with open(path) as f:
        records = [_parse(path, n, line) for n, line in enumerate(f, 1) if line.strip()]
    if not any("session_id" in d for d in records):
        for d in records:
            yield TraceRequest(
                int(d.get("timestamp") or 0), d["input_length"], d["output_length"], d["hash_ids"]
            )
        return
    sessions: dict[str, list[dict[str, Any]]] = {}
    for n, d in enumerate(records):
        sessions.setdefault(str(d.get("session_id", f"#{n}")), []).append(d)
    timed: list[tuple[float, int, TraceRequest]] = []
    seed = REPLY_SEED_BASE
    for turns in sessions.values():
        t = float(turns[0].get("timestamp") or 0.0)
        history: tuple[TraceRequest, ...] = ()
        for k, d in enumerate(turns):
            if k:
                t += float(d.get("delay") or 0.0)
            req = TraceRequest(
                int(t), d["input_length"], d["output_length"], d["hash_ids"], history, seed
            )
            seed += 1
            timed.append((t, len(timed), req))
            history = (*history, req._replace(history=()))
    timed.sort(key=lambda x: (x[0], x[1]))
    for _, _, req in timed:
        yield req


def _id_tokens(req: TraceRequest, t: int) -> np.ndarray:
    ids = np.asarray(req.hash_ids, dtype=np.uint64)
    toks = (ids[:, None] * np.uint64(t) + np.arange(t, dtype=np.uint64)[None, :]).reshape(-1)
    if req.input_length > toks.size:
        raise ValueError(
            f"input_length {req.input_length} exceeds {len(req.hash_ids)} blocks of {t} tokens"
        )
    return (toks[: req.input_length] & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def prompt_tokens(req: TraceRequest, trace_block_tokens: int) -> np.ndarray:
    """Block h holds token ids h*T .. h*T+T-1 (mod 2**32): distinct runs, same for the same id.
    A session turn's prompt is its history (each turn's tokens, then its reply) and then its own."""
    if not req.history:
        return _id_tokens(req, trace_block_tokens)
    parts = []
    for turn in req.history:
        parts.append(_id_tokens(turn, trace_block_tokens))
        parts.append(output_tokens(turn.reply_seed, turn.output_length))
    parts.append(_id_tokens(req, trace_block_tokens))
    return np.concatenate(parts)


def output_tokens(index: int, length: int) -> np.ndarray:
    """Generated tokens: unique to the request (ids above any prompt token's range)."""
    rng = np.random.default_rng(index)
    return rng.integers(2**31, 2**32 - 1, size=length, dtype=np.uint32)


ATTENTION_CONTEXT = 24_576  # 6 x hidden 4096: an 8B-class model (see prefill_cost)


def prefill_cost(num_tokens: int, attention_context: int = ATTENTION_CONTEXT) -> float:
    """Relative compute to prefill tokens 0..n-1 from scratch: the token at position p costs
    ``1 + p / C``. Per layer a token's linear layers take ~24 d^2 FLOPs (QKV/O 8 d^2, MLP
    16 d^2) and its attention over the p tokens before it ~4 p d, so ``C = 6 d`` (d: the hidden
    size); a cached prefix of h tokens saves ``prefill_cost(h)``: deeper blocks save more."""
    n = num_tokens
    return n + n * (n - 1) / (2 * attention_context)


def replay(
    requests: list[TraceRequest] | Iterator[TraceRequest],
    capacity_tokens: int,
    *,
    policy: EvictionPolicy | str | None = None,
    block_size: int = 512,
    trace_block_tokens: int = 512,
    with_output: bool = False,
    check_every: int = 0,
    before_request: Callable[[int, TraceRequest], None] | None = None,
    attention_context: int = ATTENTION_CONTEXT,
    name: str = "replay",
) -> dict[str, Any]:
    """Replay ``requests``; ``before_request(i, req)`` runs before each one is served (the
    offline reference policies in benchmarks/ use it to see the future). ``compute_saved`` in
    the result: the fraction of the prompts' prefill compute the hits saved (``prefill_cost``).
    ``name`` is the cache's namespace, which every block hash covers: the what-if miniatures
    sample other blocks under another name (a fixed policy decides the same)."""
    cache = PromptCache(name, block_size=block_size, ram_budget=capacity_tokens, policy=policy)
    t0 = time.perf_counter()
    num = prompt_total = cached_total = 0
    cost_total = cost_saved = 0.0
    for i, req in enumerate(requests):
        if before_request is not None:
            before_request(i, req)
        tokens = prompt_tokens(req, trace_block_tokens)
        seq = cache.sequence(tokens)
        with cache.lookup(seq) as hit:
            cached_total += hit.num_tokens
            cost_saved += prefill_cost(hit.num_tokens, attention_context)
        prompt_total += seq.num_tokens
        cost_total += prefill_cost(seq.num_tokens, attention_context)
        num += 1
        if with_output and req.output_length:
            seed = req.reply_seed if req.reply_seed >= 0 else i
            seq = seq.extend(output_tokens(seed, req.output_length))
        cache.save(seq, None, null_slicer)
        if check_every and i % check_every == 0:
            cache.check_integrity()
    stats = cache.stats()
    return {
        **(stats.whatif or {}),
        "hit_rate": cached_total / prompt_total if prompt_total else 0.0,
        "compute_saved": cost_saved / cost_total if cost_total else 0.0,
        "requests": num,
        "prompt_tokens": prompt_total,
        "cached_tokens": cached_total,
        "evicted_blocks": stats.num_evictions,
        "seconds": time.perf_counter() - t0,
        "policy": stats.policy,
        "capacity_tokens": capacity_tokens,
        "block_size": block_size,
    }
