"""What every endpoint shares: the engine, the chat formatter, the metrics, tenant resolution."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from promptcache.core.figures import Series
from promptcache.core.images import ImageSpan
from promptcache.engines.base import (
    Engine,
    EngineLimits,
    Finished,
    PrefillDone,
)
from promptcache.server.chat import Chat, ChatFormatter
from promptcache.server.diagnosis import PromptMemory, diagnose
from promptcache.server.guard import KeyGrant
from promptcache.server.image_parts import ImagePolicy
from promptcache.server.metrics import ServerMetrics
from promptcache.server.records import CacheRecord, RequestRecords
from promptcache.server.response_store import ResponseStore
from promptcache.server.script import ReplyScript
from promptcache.server.session_registry import CallHolder, SessionRegistry

TENANT_HEADER = "x-promptcache-tenant"
log = logging.getLogger("promptcache.cache")


class QueueFullError(Exception):
    """Too many requests waiting for the engine (the server answers 429 with Retry-After)."""

    def __init__(self, limit: int, retry_after_s: int = 2) -> None:
        super().__init__(
            f"the server is busy: {limit} requests are already running or queued (--max-queue); "
            "retry later"
        )
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask of the server (flags with defaults a laptop survives)."""

    max_queue: int = 32  # requests running or waiting for the engine
    request_timeout_s: float | None = 900.0  # from arrival to the last token
    max_body_bytes: int = 16 * 2**20
    max_prompt_tokens: int | None = None  # default: the context
    max_stop_strings: int = 16
    max_stop_chars: int = 512
    api_keys: dict[str, KeyGrant] = field(default_factory=dict)  # key digest -> grant
    loopback_only: bool = True  # refuse foreign Host headers (DNS rebinding)
    allow_image_urls: bool = False  # fetch http(s) image URLs (vision models; else 400)
    max_image_bytes: int = 20 * 2**20  # one image, encoded


class ServerState:
    def __init__(
        self,
        engine: Engine,
        *,
        model_id: str | None = None,
        default_max_tokens: int | None = None,
        max_output_tokens: int | None = None,
        strict_max_tokens: bool = False,
        keep_billing_header: bool = False,
        limits: Limits | None = None,
        hit_rate_alert: float = 0.8,
        hit_rate_window: int = 50,
        script: ReplyScript | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        self.engine = engine
        # what the engine can take, read once: the server's checks never reach into it
        self.engine_limits: EngineLimits = engine.limits
        self.script = script  # scripted replies (tests of agent clients): forced token ids
        self.model_id = model_id or engine.model_id
        # a request that names no output limit: this many tokens, or (None) until the context
        # is full, as llama.cpp, Ollama, LM Studio and OpenAI's own API do
        self.default_max_tokens = default_max_tokens
        self.max_output_tokens = max_output_tokens
        self.strict_max_tokens = strict_max_tokens  # a max_tokens over the room: 400, not clamped
        self.keep_billing_header = keep_billing_header
        self.metrics = ServerMetrics()
        self.formatter = ChatFormatter(engine, tool_parser, reasoning_parser)
        self.limits = limits or Limits()
        self.num_active = 0  # requests running or waiting for the engine (event-loop owned)
        self.records = RequestRecords(alert_below=hit_rate_alert, window=hit_rate_window)
        self.prompts = PromptMemory()  # what miss diagnosis compares a prompt with
        self.responses = responses or ResponseStore()  # stored Responses API responses
        self.is_cache_on = self.engine_limits.block_size is not None
        self.image_policy = ImagePolicy(
            enabled=self.engine_limits.supports_images,
            allow_urls=self.limits.allow_image_urls,
            max_image_bytes=self.limits.max_image_bytes,
        )
        # everything holding session data, forgotten together when a session is deleted
        self.sessions = SessionRegistry(engine.cache_admin)
        for holder in (self.prompts, self.formatter.replies, self.records, self.responses):
            self.sessions.register(holder)
        self.sessions.register(CallHolder("image_embeddings", engine.forget_images))

    def tenant_of(self, request: Request, user: str | None = None) -> str:
        """Cache namespace of a request: with API keys the key's tenant only; without, the
        tenant header, else empty (one shared tenant). Tenants never share a cached block."""
        grant = request.scope.get("state", {}).get("grant")
        if grant is not None:
            return str(grant.tenant)
        return request.headers.get(TENANT_HEADER, "")

    def output_budget(self, asked: int | None) -> int:
        """The max_tokens of a request that asked for ``asked`` (None: it named no limit);
        ``prepare.prepare_ids`` then fits it in the room the prompt leaves."""
        return asked or self.default_max_tokens or self.engine_limits.max_context

    def record(
        self,
        endpoint: str,
        tenant: str,
        prompt: list[int],
        chat: Chat | None,
        prefill: PrefillDone | None,
        fin: Finished,
        started_s: float = float("inf"),
        images: tuple[ImageSpan, ...] = (),
        session: str = "",
    ) -> CacheRecord:
        """The request's cache record: reuse, tiers, saved time and the miss reason."""
        records = self.records
        rid = records.next_id()
        tokens = np.asarray(prompt, dtype=np.uint32)
        report = prefill.lookup if prefill is not None else None
        marks = tuple((s.start, s.image.digest) for s in images)  # images by first token

        def locate(token: int) -> tuple[int, str]:
            try:
                return self.formatter.message_at(chat, tenant, token) if chat else (-1, "")
            except Exception:  # a template that cannot render a prefix of the chat
                return -1, ""

        if prefill is None:
            reason, detail = "cancelled", {}
        else:
            miss = diagnose(
                tokens,
                report,
                self.prompts,
                tenant,
                may_name_namespaces=not self.limits.api_keys,
                decode=self.engine.decode,
                locate=locate,
                now_s=time.time(),
                started_s=started_s,
                images=marks,
            )
            reason, detail = miss.reason, miss.detail
            saved = tokens
            if fin.reason not in ("cancelled", "timeout") and fin.completion_ids:
                saved = np.concatenate([tokens, np.asarray(fin.completion_ids, dtype=np.uint32)])
            self.prompts.add(tenant, rid, saved, time.time(), marks, session)
        ttft = prefill.ttft_s if prefill is not None else None
        records.rate.observe(ttft, fin.prompt_tokens - fin.cached_tokens)
        rec = CacheRecord(
            request_id=rid,
            time_s=time.time(),
            tenant=tenant,
            endpoint=endpoint,
            finish=fin.reason,
            prompt_tokens=fin.prompt_tokens,
            cached_tokens=fin.cached_tokens,
            completion_tokens=fin.completion_tokens,
            hit_kind=prefill.hit_kind if prefill is not None else "none",
            tokens_by_tier=dict(report.tokens_by_tier) if report is not None else {},
            ttft_s=ttft,
            saved_s=records.rate.saved(fin.cached_tokens),
            reason=reason,
            detail=detail,
            session=session,
            phases=prefill.phases.to_dict() if prefill is not None and prefill.phases else {},
        )
        records.add(rec)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %d (%s): reused %d of %d prompt tokens; miss reason %s %s",
                rid, tenant or "default", fin.cached_tokens, fin.prompt_tokens, reason, detail,
            )  # fmt: skip
        return rec

    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def cache_series(self) -> list[Series]:
        return self.engine.cache_series()

    def continuity_stats(self) -> dict[str, Any]:
        return self.formatter.replies.stats()
