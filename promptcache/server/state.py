"""What every endpoint shares: the engine, the chat formatter, the metrics, tenant resolution."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from starlette.requests import Request

from promptcache.core.images import ImageSpan
from promptcache.engines.base import (
    Engine,
    EngineLimits,
    Event,
    Finished,
    PrefillDone,
    PromptTooLongError,
    RequestError,
    SamplingParams,
)
from promptcache.server.chat import Chat, ChatFormatter, new_call_id
from promptcache.server.diagnosis import PromptMemory, diagnose
from promptcache.server.guard import KeyGrant
from promptcache.server.image_parts import ImagePolicy, check_count
from promptcache.server.metrics import ServerMetrics
from promptcache.server.records import CacheRecord, RequestRecords
from promptcache.server.response_store import ResponseStore
from promptcache.server.script import ReplyScript
from promptcache.server.session_registry import CallHolder, SessionRegistry
from promptcache.server.streaming import run_events
from promptcache.server.tool_kinds import ignored_header
from promptcache.serving.context import fit_output
from promptcache.tools import ToolCall

TENANT_HEADER = "x-promptcache-tenant"
CLAMP_HEADER = "x-promptcache-max-tokens-clamped"  # the max_tokens the request got instead
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


class Prepared(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    tenant: str
    is_capped: bool = False  # --max-output-tokens lowered the client's max_tokens
    images: tuple[ImageSpan, ...] = ()  # where the prompt's images sit (vision models)
    clamped_from: int | None = None  # the max_tokens lowered to the room left in the context
    ignored_tools: tuple[str, ...] = ()  # tool kinds left out of the prompt

    @property
    def headers(self) -> dict[str, str]:
        """What the response says about the request: a clamped max_tokens, tools set aside."""
        out = ignored_header(self.ignored_tools)
        if self.clamped_from is not None:
            out[CLAMP_HEADER] = str(self.params.max_tokens)
        return out


class Reply(NamedTuple):
    content: str
    calls: list[tuple[str, ToolCall]]  # (call id, call)
    reasoning: str = ""  # never part of content


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
        ``prepare_ids`` then fits it in the room the prompt leaves."""
        return asked or self.default_max_tokens or self.engine_limits.max_context

    def check_prompt(self, prompt: list[int]) -> None:
        """The server's own prompt limit (--max-prompt-tokens); the context is the engine's
        one check (``serving.context``), an empty prompt too."""
        cap = self.limits.max_prompt_tokens
        if cap and len(prompt) > cap:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens; this server takes at most {cap} per "
                "request (--max-prompt-tokens)",
                len(prompt),
                cap,
            )

    def prepare(
        self, request: Request, chat: Chat, params: SamplingParams, explicit_max: bool = True
    ) -> Prepared:
        """Render, check and constrain a chat request; raises a 4xx-mapped error when it can't
        be served. ``params.max_tokens`` is capped by ``--max-output-tokens`` and the room left
        in the context (``explicit_max``: the client asked for it, so --strict-max-tokens
        refuses it instead)."""
        tenant = self.tenant_of(request)
        prompt, images = self.formatter.render_prompt(chat, tenant)
        check_count([s.image for s in images], self.image_policy)
        params.grammar = self.formatter.grammar(chat)
        if self.script is not None:
            params.forced_ids = self.script.forced_ids(chat, self.formatter.parser, self.engine)
        prep = self.prepare_ids(request, prompt, params, tenant, explicit_max, images)
        self.formatter.check_continuity(chat, tenant, prompt, params.session)
        return prep._replace(ignored_tools=tuple(chat.ignored_tools))

    def prepare_ids(
        self,
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        explicit_max: bool = True,
        images: tuple[ImageSpan, ...] = (),
    ) -> Prepared:
        """The checks and output budget of a rendered prompt (raw completions start here)."""
        self.check_prompt(prompt)
        is_capped = self.cap_output(params)
        strict = self.strict_max_tokens and explicit_max
        context = self.engine_limits.max_context
        fit = fit_output(len(prompt), params.max_tokens, context, strict)
        params.max_tokens = fit.max_tokens
        if not explicit_max:  # the server's own default fits the room: nothing to tell
            fit = fit._replace(clamped_from=None)
        if fit.clamped_from is not None:
            log.info(
                "%s: max_tokens %d clamped to %d, the room left in the %d-token context by a "
                "%d-token prompt (--strict-max-tokens refuses instead)",
                request.url.path, fit.clamped_from, fit.max_tokens, context,
                len(prompt),
            )  # fmt: skip
        self.check_params(params)
        return Prepared(prompt, params, tenant, is_capped, images, fit.clamped_from)

    def check_params(self, params: SamplingParams) -> None:
        """Stop-string limits and the time budget; then the engine's own checks."""
        lim = self.limits
        if len(params.stop) > lim.max_stop_strings:
            raise RequestError(
                f"at most {lim.max_stop_strings} stop strings per request, not {len(params.stop)}"
            )
        if any(len(s) > lim.max_stop_chars for s in params.stop):
            raise RequestError(f"a stop string may have at most {lim.max_stop_chars} characters")
        params.timeout_s = lim.request_timeout_s
        params.validate()

    def cap_output(self, params: SamplingParams) -> bool:
        """Apply --max-output-tokens; True when it lowered the client's max_tokens."""
        if not self.max_output_tokens or params.max_tokens <= self.max_output_tokens:
            return False
        params.max_tokens = self.max_output_tokens
        return True

    def finish_reply(self, chat: Chat, prep: Prepared, fin: Finished, id_prefix: str) -> Reply:
        """Tool calls parsed out of a finished reply (with fresh ids); remembered so that the
        next turn renders this reply to the same tokens."""
        parsed = self.formatter.parse(chat, fin.text)
        if fin.reason != "cancelled":
            self.formatter.remember(
                prep.tenant,
                parsed,
                fin.text,
                prep.prompt + list(fin.completion_ids),
                prep.params.session,
            )
        calls = [(c.id or new_call_id(id_prefix), c) for c in parsed.calls]
        return Reply(parsed.content, calls, parsed.reasoning)

    async def events(
        self,
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        chat: Chat | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> AsyncIterator[Event]:
        if self.num_active >= self.limits.max_queue:
            raise QueueFullError(self.limits.max_queue)
        self.num_active += 1
        try:
            async for ev in self._events(request, prompt, params, tenant, chat, images):
                yield ev
        finally:
            self.num_active -= 1

    async def _events(
        self,
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        chat: Chat | None,
        images: tuple[ImageSpan, ...],
    ) -> AsyncIterator[Event]:
        endpoint = request.url.path
        # only a vision engine takes images= (a text-only one never gets any: 400 at the edge)
        extra: dict[str, Any] = {"images": images} if images else {}

        def generate(cancel: threading.Event) -> Iterator[Event]:
            # counted on the worker thread: a request whose client left is counted too
            started = time.time()
            prefill: PrefillDone | None = None
            for ev in self.engine.generate(prompt, params, tenant, cancel, **extra):
                if isinstance(ev, PrefillDone):
                    prefill = ev
                elif isinstance(ev, Finished) and ev.prompt_tokens:
                    ttft = prefill.ttft_s if prefill else None
                    self.metrics.record(
                        ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ttft
                    )
                    self.record(
                        endpoint, tenant, prompt, chat, prefill, ev, started, images, params.session
                    )
                yield ev

        async for ev in run_events(request, generate):
            yield ev

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

    def continuity_stats(self) -> dict[str, Any]:
        return self.formatter.replies.stats()
