"""What every endpoint shares: the engine, the metrics, tenant resolution."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from promptcache.engines.base import (
    Engine,
    Event,
    Finished,
    PrefillDone,
    PromptTooLongError,
    SamplingParams,
)
from promptcache.server.metrics import ServerMetrics
from promptcache.server.streaming import run_events

TENANT_HEADER = "x-promptcache-tenant"


class ServerState:
    def __init__(
        self, engine: Engine, *, model_id: str | None = None, default_max_tokens: int = 512
    ) -> None:
        self.engine = engine
        self.model_id = model_id or engine.model_id
        self.default_max_tokens = default_max_tokens
        self.metrics = ServerMetrics()

    def tenant_of(self, request: Request, user: str | None = None) -> str:
        """Cache namespace of a request: the tenant header, else empty (one shared tenant).

        Requests in different tenants never share a cached block."""
        return request.headers.get(TENANT_HEADER, "")

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.engine.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens, over this server's context of {self.engine.max_context} tokens"
            )

    async def events(
        self, request: Request, prompt: list[int], params: SamplingParams, tenant: str
    ) -> AsyncIterator[Event]:
        prefill: PrefillDone | None = None
        async for ev in run_events(
            request, lambda cancel: self.engine.generate(prompt, params, tenant, cancel)
        ):
            if isinstance(ev, PrefillDone):
                prefill = ev
            elif isinstance(ev, Finished):
                self.metrics.record(
                    ev.prompt_tokens,
                    ev.cached_tokens,
                    ev.completion_tokens,
                    prefill.ttft_s if prefill else None,
                )
            yield ev

    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()
