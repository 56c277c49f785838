"""Continuous batching: how one engine step is composed from every request that can move.

A step takes every active request whose consumer is keeping up (the scheduler picks them) and,
in this order (prefill priority: a newcomer's first token does not wait for the decode forward):

1. **final saves, if a new request arrived**: the last sampled token of every finished reply is
   fed and prompt + reply saved before any lookup, so a session's next turn hits the reply it
   follows (without newcomers the saves ride in the decode forward of step 4);
2. **new requests** look their prompt up and restore the cached prefix, unless another request
   in flight is prefilling a prefix they share right now (a block or more past what it has
   saved): then they wait (``waited``) and look up once those tokens are saved (it saves at
   every chunk boundary): agents firing parallel calls with the same long prefix compute it
   once (``inflight_dedup_tokens`` in the stats);
3. **prefill within the token budget**: ``step_tokens`` (default ``DEFAULT_STEP_TOKENS``, 128)
   tokens per step in all, the one-token steps of step 4 counted first; under load the budget
   grows with the requests in the step (``ROW_SHARE`` of ``step_tokens`` each, at most
   ``max_step_tokens``, default ``MAX_STEP_TOKENS``): every step pays one decode forward over
   every decoding row (on a CPU, attention over all their contexts), so many sessions with a
   small budget spend their time on decode forwards between small prefill pieces (16 agent
   sessions: 15.6 output tok/s at 128 tokens a step, 23.3 at 1,536). Prefill goes to the
   prompts with the fewest tokens left (a short request is not stuck behind a long prompt), and
   a step in which some prompt completes takes no further partial pieces (its first token goes
   out a step sooner); a request that did not get its share goes first next step, the one
   passed over most often first (a long prompt is not starved by a stream of shorter ones). On attention-only models a chunk runs in budget-sized pieces, so the
   budget bounds a step's length (how long a newcomer waits); with snapshot layers (sliding
   window, SSM) whole chunks run, since splitting an SSM's scan changes its numerics. A request
   alone in the engine runs whole chunks too (fewer forwards: each one streams every weight and
   copies the whole KV cache once); one arriving meanwhile waits at most that chunk. On
   attention-only layouts a rest that fits the budget runs in one forward, across a chunk
   boundary if it has to (the save at the prompt's end covers that boundary). At least
   one piece runs per step (``MIN_PIECE`` tokens when decode took the budget). Saves stay at
   multiples of ``prefill_chunk`` and the prompt's end: the cache's blocks and checkpoints land
   where they would for a request alone. A prompt completed here has its first token sampled
   and delivered (``on_events``: the scheduler puts it in the outbox and wakes the consumer): it
   streams while step 4 runs;
4. **one forward for every one-token step**: the next token of every request that was decoding
   when the step began (and any final save left) go through the model together
   (``Steps.one_token_steps``; the runners batch one-token steps: ``torch.batch``,
   ``mlx.batch``).

Where the runner packs sequences of any length into one forward (a ``PackedRunner``: torch's
lean models) and a step has more than one row, parts 3 and 4 are one forward: every prefill
piece and every one-token step side by side (``Steps.packed_step``), so the weights are read
once per step instead of once per prefilling request plus once for the decodes (on a CPU most
of a small piece's or a decode forward's time; ``benchmarks/packed_bench.py``: a step of 2-8
pieces of 32 tokens beside 8 decode rows in 0.61-0.69x the time, of 384-token pieces 0.9x,
where the matmuls are compute-bound either way). The pieces are chosen as above; the prompts
they complete get their first token with the forward that decodes the others.

The batcher never sets a request's phase nor fills its outbox: each part returns what happened
(a ``Moved``: the next phase or the error, and the events), and ``advance_batch`` hands the
scheduler those. What the batcher writes on a request is its own bookkeeping of the policy
(``waited``, ``skipped``).

Requests join at any step (their lookup happens in the step they arrive) and leave when they
finish: nothing waits for a batch to fill or drain. A decoding request's inter-token latency is
one step: the batched forward plus at most ``step_tokens`` prefill tokens. A request's time to
first token under load is what is left of the step running when it arrives, plus its own lookup
and prefill (when its prompt fits the budget left by the decode tokens).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from promptcache.core.figures import Series, Snapshot
from promptcache.serving.request import Moved, Phase, Request
from promptcache.serving.steps import Steps

DEFAULT_STEP_TOKENS = 128  # ~1 s of prefill deep into an 8K prompt of a 135M model on 2 CPU cores
MIN_PIECE = 32  # the least prefill a step runs when decode tokens took the whole budget
ROW_SHARE = 1.5  # of step_tokens per request in a step: the budget grows with the load
# the most a step's budget grows to: a newcomer waits out the step in progress and then its own;
# load_bench, 4-32 agent sessions: 512 cut TTFT p50 to 0.3-0.7x of 4,096's; tok/s higher at 4-16
MAX_STEP_TOKENS = 512


class Batcher:
    """The scheduler's ``Work``: composes and runs one step over many requests. Errors stay with
    their request (a failed batched forward fails the requests in it)."""

    def __init__(
        self,
        steps: Steps,
        step_tokens: int,
        min_shared: int,
        max_step_tokens: int = MAX_STEP_TOKENS,
    ) -> None:
        self.steps = steps
        self.step_tokens = step_tokens
        self.max_step_tokens = max(max_step_tokens, step_tokens)  # never below the base budget
        # pieces smaller than a chunk only where the split cannot change the saved state's
        # numerics beyond float noise: attention-only layouts (an SSM's chunked scan would)
        self.splits = steps.can_split_chunks
        self.min_shared = min_shared  # a shared prefix shorter than this is not worth waiting for
        self._lock = threading.Lock()  # the counters are read by stats() from other threads
        self.num_steps = 0
        self.num_batched_forwards = 0  # forwards of more than one sequence
        self.batched_rows = 0  # sequences in those forwards
        self.max_batch_rows = 0
        self.num_inflight_waits = 0  # requests that waited for another's prefill
        self.inflight_dedup_tokens = 0  # prompt tokens they then restored instead of computing
        self.num_packed_forwards = 0  # forwards of prefill pieces with other rows (``_packed``)
        self.packed_pieces = 0  # prefill pieces in those
        # called with the parts of a step that produced events before its end (the scheduler
        # delivers them and wakes their consumers; the default keeps them for the step's end)
        self.on_events: Callable[[Mapping[Request, Moved]], bool] = _keep

    # -- the scheduler's Work ---------------------------------------------------------------

    def advance_batch(self, reqs: Sequence[Request]) -> dict[Request, Moved]:
        steps = self.steps
        moved: dict[Request, Moved] = {}  # what happened to each request; the scheduler applies it
        one: list[Request] = []  # decode steps and final saves: one token each, in step order
        new: list[Request] = []
        prefill: list[Request] = []
        for req in reqs:
            if req.phase is Phase.SAVE:  # no deadline, no cancel: the reply is out
                one.append(req)
            elif req.is_expired():
                moved[req] = _guard(req, steps.time_out)
            elif req.is_cancelled:
                moved[req] = _guard(req, steps.cancel)
            elif req.phase is Phase.DECODE:
                one.append(req)
            elif req.phase is Phase.NEW:
                new.append(req)
            elif req.phase is Phase.PREFILL:
                prefill.append(req)
        budget = self.step_budget(len(reqs)) - len(one)
        if len(reqs) == 1 and not one:  # alone: nobody waits behind it, whole chunks
            budget = max(budget, self.steps.prefill_chunk)
        saves = [r for r in one if r.phase is Phase.SAVE]
        if new and saves:  # saved before any lookup: a new turn hits the reply it follows
            self._one_token_steps(saves, moved)
            one = [r for r in one if r.phase is Phase.DECODE]  # the same order: a kept batch
        for req in new:
            if self._wait_for_inflight(req, prefill):
                continue
            moved[req] = _guard(req, self._begin)
            if moved[req].outcome is Phase.PREFILL:
                prefill.append(req)
        pieces = self._plan_pieces(prefill, budget, moved)
        if self._packed(pieces, one, moved):
            one = []  # they rode in the packed forward
        else:
            # prefill before the decode forward: a prompt completing here sends its first token
            # now, and its consumer (woken) streams it while the forward runs
            for req, end in pieces:
                moved[req] = _guard(req, partial(self.steps.prefill_step, end=end))
        ready = {r: m for r, m in moved.items() if m.events}
        if ready and self.on_events(ready):  # delivered: only the outcomes are left to apply
            for req, m in ready.items():
                moved[req] = Moved(m.outcome)
        self._one_token_steps(one, moved)
        with self._lock:
            self.num_steps += 1
        return moved

    def step_budget(self, num_reqs: int) -> int:
        """Tokens for a step over ``num_reqs`` requests: ``step_tokens``, or more under load."""
        grown = min(self.max_step_tokens, int(self.step_tokens * ROW_SHARE * num_reqs))
        return max(self.step_tokens, grown)

    def time_out(self, req: Request) -> Moved:
        return self.steps.time_out(req)

    def cancel(self, req: Request) -> Moved:
        return self.steps.cancel(req)

    def stats(self) -> Snapshot:
        with self._lock:
            counts = {
                "num_engine_steps": self.num_steps,
                "num_batched_forwards": self.num_batched_forwards,
                "batched_rows": self.batched_rows,
                "num_inflight_waits": self.num_inflight_waits,
                "inflight_dedup_tokens": self.inflight_dedup_tokens,
                "num_packed_forwards": self.num_packed_forwards,
                "packed_pieces": self.packed_pieces,
            }
            peak = self.max_batch_rows
        series = [Series(k, "counter", v) for k, v in counts.items()]
        return Snapshot(
            {**counts, "max_batch_rows": peak}, (*series, Series("max_batch_rows", "gauge", peak))
        )

    # -- the parts of a step ----------------------------------------------------------------

    def _one_token_steps(self, reqs: list[Request], moved: dict[Request, Moved]) -> None:
        if not reqs:
            return
        is_save = [r.phase is Phase.SAVE for r in reqs]
        outcomes, batched = self.steps.one_token_steps(reqs, is_save)
        moved.update(zip(reqs, outcomes, strict=True))
        if batched:
            self._count_batch(len(reqs))

    def _packed(
        self, pieces: list[tuple[Request, int]], one: list[Request], moved: dict[Request, Moved]
    ) -> bool:
        """The step's prefill pieces and its one-token steps in one forward, where the runner
        packs them (``Steps.packs``): the weights streamed once instead of once per request
        (most of a small forward's time on a CPU). The step's first tokens then go out with the
        forward that decodes the others (its decode rows cost the prefill little beside their
        attention). False (nothing run): a lone piece, or a runner that cannot."""
        reqs = [r for r, _ in pieces] + one
        if not pieces or len(reqs) < 2 or not self.steps.packs(reqs):
            return False
        outcomes = self.steps.packed_step(pieces, one, [r.phase is Phase.SAVE for r in one])
        moved.update(zip(reqs, outcomes, strict=True))
        self._count_batch(len(reqs))
        with self._lock:
            self.num_packed_forwards += 1
            self.packed_pieces += len(pieces)
        return True

    def _count_batch(self, rows: int) -> None:
        with self._lock:
            self.num_batched_forwards += 1
            self.batched_rows += rows
            self.max_batch_rows = max(self.max_batch_rows, rows)

    def _begin(self, req: Request) -> Moved:
        out = self.steps.begin_step(req)
        if req.waited:
            with self._lock:
                self.num_inflight_waits += 1
                self.inflight_dedup_tokens += min(req.cached, req.waited)
        return out

    def _wait_for_inflight(self, req: Request, prefilling: list[Request]) -> bool:
        """True when a request in flight is prefilling (and will save) at least ``min_shared``
        tokens of a prefix ``req`` shares beyond what it has saved so far: ``req`` looks up
        after it, not alongside. (Prompts that part a token or two after a saved prefix, as
        "Task 1" and "Task 12" do, do not wait: a step or more for nothing to restore.)"""
        if not self.steps.has_cache:
            return False
        chunk = self.steps.prefill_chunk
        for other in prefilling:
            if other.tenant != req.tenant or other.pos >= len(req.prompt):
                continue
            shared = _common_prefix(req.prompt, other.prompt)
            saved = max(other.cached, other.pos - other.pos % chunk)  # saves at chunk ends
            if shared > other.pos and shared - saved >= self.min_shared:
                req.waited = max(req.waited, shared)
                return True
        return False

    def _plan_pieces(
        self, reqs: list[Request], budget: int, moved: dict[Request, Moved]
    ) -> list[tuple[Request, int]]:
        """The prefill pieces this step runs: (request, where its piece ends)."""
        pieces: list[tuple[Request, int]] = []
        # the most skipped first (shortest-first alone starves a long prompt while shorter ones
        # keep arriving: many sessions at once), then the fewest tokens left
        order = sorted(reqs, key=lambda r: (-r.skipped, r.num_prompt - r.pos))
        ran = delivered = False
        for req in order:
            if req in moved and moved[req].outcome is not Phase.PREFILL:
                continue
            end = self.steps.chunk_end(req)
            if self.splits and req.num_prompt - req.pos <= budget:
                # the rest fits: one forward across a chunk boundary, not two (the save at the
                # prompt's end covers that boundary's blocks; attention-only layouts)
                end = req.num_prompt
            elif self.splits:  # a piece of the chunk: the budget bounds the step's length
                end = min(end, req.pos + max(budget, 0 if ran else MIN_PIECE))
            finishes = end == req.num_prompt
            # a step that completes some prompt ends there (its first token reaches the client
            # a step sooner); a piece that does not fit waits for the next step, first in line
            if ran and (end - req.pos > budget or end <= req.pos or (delivered and not finishes)):
                req.skipped += 1
                continue
            req.skipped = 0
            ran = True
            budget -= end - req.pos
            delivered = delivered or finishes
            pieces.append((req, end))
        return pieces


def _keep(ready: Mapping[Request, Moved]) -> bool:
    return False  # not delivered early: the scheduler applies them with the rest of the step


def _guard(req: Request, action: Callable[[Request], Moved]) -> Moved:
    """Run one request's part of the step; its exception is its outcome (for its consumer)."""
    try:
        return action(req)
    except Exception as exc:
        return Moved(exc)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case for identical or extended prompts: one C-level compare
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect with slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
