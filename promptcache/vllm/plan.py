"""The scheduler's side of the connector, without vLLM types: which blocks each step loads and
saves, as plain ops the worker carries out.

A request's blocks are vLLM's blocks: block ``i`` of its tokens lives in ``block_ids[i]`` of
vLLM's paged KV and in one cache block. Loads cover the blocks between vLLM's own hit and what
our tiers hold; saves cover every full block once its KV is computed, prompt and reply alike
(the next turn hits the reply too, as on our server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from promptcache.vllm.settings import RequestTags


@dataclass(slots=True)
class LoadOp:
    req_id: str
    tokens: list[int]  # the request's tokens, at least one past the loaded blocks
    block_ids: list[int]  # vLLM's blocks of the request, in order
    start_block: int  # the first block to load (vLLM's own hit ends before it)
    num_blocks: int
    tags: RequestTags


@dataclass(slots=True)
class SaveOp:
    req_id: str
    tokens: list[int]  # whole blocks only: the KV of every one of them is computed this step
    block_ids: list[int]
    start_block: int  # blocks before it were handed over by an earlier step
    tags: RequestTags


@dataclass(slots=True)
class StepOps:
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass(slots=True)
class Tracked:
    """A request the scheduler side follows between steps."""

    tags: RequestTags
    request: Any  # vLLM's Request: its token list grows as it decodes
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0
    pending_load: int = 0  # blocks to load, ending where the step's computed tokens start


class StepPlanner:
    """Per-request bookkeeping across steps (the scheduler's thread only)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, Tracked] = {}

    def track(self, req_id: str, request: Any, tags: RequestTags) -> Tracked:
        t = self.requests.get(req_id)
        if t is None or t.request is not request:
            t = self.requests[req_id] = Tracked(tags, request)
        return t

    def plan_load(self, req_id: str, num_external: int) -> None:
        t = self.requests.get(req_id)
        if t is not None and num_external > 0:
            t.pending_load = num_external // self.block_size

    def step(
        self,
        scheduled: list[tuple[str, list[int] | None, bool, int, int]],
    ) -> StepOps:
        """``scheduled``: (req id, block ids new this step or None, whether they replace the
        old ones, tokens computed before the step, tokens scheduled) per request."""
        ops = StepOps()
        bs = self.block_size
        for req_id, new_blocks, replace, num_computed, num_scheduled in scheduled:
            t = self.requests.get(req_id)
            if t is None:
                continue
            if new_blocks is not None:
                t.block_ids = list(new_blocks) if replace else t.block_ids + list(new_blocks)
            tokens = list(t.request.all_token_ids)
            if t.pending_load:
                # the step's computed tokens are vLLM's own hit plus the blocks we load
                count, t.pending_load = t.pending_load, 0
                start = num_computed // bs - count
                end = min((start + count) * bs + 1, len(tokens))
                ops.loads.append(
                    LoadOp(req_id, tokens[:end], t.block_ids[: start + count], start, count, t.tags)
                )
            done = min(num_computed + num_scheduled, len(tokens)) // bs
            done = min(done, len(t.block_ids))
            if done > t.num_saved_blocks:
                ops.saves.append(
                    SaveOp(
                        req_id, tokens[: done * bs], t.block_ids[:done], t.num_saved_blocks, t.tags
                    )
                )
                t.num_saved_blocks = done
        return ops

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
