"""Admission: whether a new request may start beside the running ones, under the cap on their
model state (``--max-live-bytes``; by default ``memory_books.default_live_cap``), so that many
long sessions queue rather than swap or meet the OOM killer. The scheduler asks ``admits``;
one request always runs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from promptcache.core.budget import format_size, parse_size
from promptcache.core.worker_threads import start_thread
from promptcache.serving.memory_books import LIVE_SHARE, default_live_cap
from promptcache.serving.request import Request
from promptcache.serving.runner import FixedState, ModelRunner
from promptcache.serving.steps import Steps

log = logging.getLogger("promptcache")

NO_CAP = ("off", "none")  # --max-live-bytes values for no cap on the running requests' state
PROBE_TOKENS = 64  # the throwaway prompt that gives a first bytes-per-token rate
# admitted unmeasured while this many times the state at the last rate fits the cap
FAR_FROM_CAP = 2


class Admission:
    """The cap (``max_live_bytes``, None: none), the bytes of state per token last seen
    (``bytes_per_token``: the running requests' past their prefill, else the state kept for
    the next turn, else a probe's at start) and per request (``bytes_per_request``: SSM /
    linear-attention state, the same at any length, where the runner tells it: ``FixedState``;
    a probe's). ``admits`` runs on the stepping thread only."""

    def __init__(self, runner: ModelRunner, steps: Steps) -> None:
        self.runner, self.steps = runner, steps
        self.max_live_bytes: int | None = None  # until ``set_cap``: every request is admitted
        self.bytes_per_token: float | None = None
        self.bytes_per_request = 0

    def set_cap(self, value: int | str | None, cache: Any) -> None:
        """``--max-live-bytes``: a size, "off" (no cap), or unset: ``default_live_cap`` of the
        memory left now (call after the model's warm-up). With a cap, a first rate comes from
        a throwaway prompt (``probe_rate``), so the first requests are admitted by it too."""
        if isinstance(value, str) and value.strip().lower() in NO_CAP:
            self.max_live_bytes = None
            return
        self.bytes_per_token, self.bytes_per_request = probe_rate(self.runner)
        if value is not None:
            self.max_live_bytes = parse_size(value)
            return
        self.max_live_bytes = cap = default_live_cap(cache, self.runner)
        log.info(
            "running requests' state capped at %s (%.0f%% of the memory left; "
            "--max-live-bytes SIZE or off to change)",
            format_size(cap),
            LIVE_SHARE * 100,
        )

    def admits(self, req: Request, running: Sequence[Request]) -> bool:
        """Whether ``req``'s prompt fits beside ``running`` under the cap: what the started
        ones hold (or, at the bytes per token last seen, will hold once their prompts are in,
        if more) and the prompts admitted but not started, with ``req``'s."""
        cap = self.max_live_bytes
        if cap is None:
            return True
        started = [r for r in running if r.state is not None]
        to_come = sum(max(r.num_prompt, r.pos + len(r.generated)) for r in started)
        waiting = [r for r in running if r.state is None]
        pending = sum(r.num_prompt for r in waiting) + req.num_prompt
        fixed = self.bytes_per_request
        rate = self.bytes_per_token
        whole = fixed * (len(running) + 1)
        if rate is not None and FAR_FROM_CAP * (rate * (to_come + pending) + whole) <= cap:
            return True  # far below the cap: not worth measuring (a walk over every state)
        runner = self.runner
        held = runner.held_bytes([r.state for r in started])
        # the rate from requests past their prefill: a state sized for its whole prompt up
        # front holds far more than its prefilled positions
        done = [r for r in started if r.pos >= r.num_prompt]
        tokens = sum(r.pos + len(r.generated) for r in done)
        if tokens:
            grown = runner.held_bytes([r.state for r in done]) - fixed * len(done)
            self.bytes_per_token = max(0.0, grown / tokens)
        live = self.steps.live  # the last finished request's state: a rate before any runs
        if self.bytes_per_token is None and live is not None and live[1].num_tokens:
            grown = runner.held_bytes([live[0]]) - fixed
            self.bytes_per_token = max(0.0, grown / live[1].num_tokens)
        rate = self.bytes_per_token
        if rate is None:
            return False  # no size known yet: wait until the running request shows one
        coming = fixed * (len(waiting) + 1) + rate * pending
        return max(held, rate * to_come + fixed * len(started)) + coming <= cap


def probe_rate(runner: ModelRunner) -> tuple[float | None, int]:
    """Bytes of state per token of a throwaway ``PROBE_TOKENS``-token prompt (an overestimate
    where buffers have room ahead; replaced by the running requests' own rate once one runs),
    None when the probe fails; and the bytes of its state that do not grow with the context
    (``FixedState``; 0 where the runner does not tell), which the rate leaves out."""
    ids = [1 + i % max(1, runner.vocab_size - 1) for i in range(PROBE_TOKENS)]
    found: list[tuple[float, int]] = []

    def run() -> None:  # on a thread as the stepping thread is (its torch threads)
        try:
            state = runner.new_state(PROBE_TOKENS)
            runner.forward([state], [ids])
            fixed = runner.fixed_bytes(state) if isinstance(runner, FixedState) else 0
            found.append(((runner.held_bytes([state]) - fixed) / PROBE_TOKENS, fixed))
        except Exception as exc:
            log.debug("the state-size probe failed (%r): the first request measures it", exc)

    start_thread(run, "promptcache-probe").join()
    return found[0] if found else (None, 0)
