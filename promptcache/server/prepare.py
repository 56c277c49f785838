"""The pipeline's first steps: render a ``Chat`` to prompt ids and check the request against the
server's limits (``prepare``), or check a raw prompt's ids (``prepare_ids``). Raises a
4xx-mapped error when the request can't be served; every API goes through here
(``pipeline.open_chat`` / ``open_prompt``)."""

from __future__ import annotations

import logging
from typing import NamedTuple

from starlette.requests import Request

from promptcache.core.images import ImageSpan
from promptcache.engines.base import PromptTooLongError, RequestError, SamplingParams
from promptcache.server.chat import Chat
from promptcache.server.image_parts import check_count
from promptcache.server.state import ServerState
from promptcache.server.tool_kinds import ignored_header
from promptcache.serving.context import fit_output

CLAMP_HEADER = "x-promptcache-max-tokens-clamped"  # the max_tokens the request got instead
log = logging.getLogger("promptcache.cache")


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


def prepare(
    state: ServerState,
    request: Request,
    chat: Chat,
    params: SamplingParams,
    explicit_max: bool = True,
) -> Prepared:
    """Render, check and constrain a chat request. ``params.max_tokens`` is capped by
    ``--max-output-tokens`` and the room left in the context (``explicit_max``: the client asked
    for it, so --strict-max-tokens refuses it instead). Blocking (the template, the tokenizer)."""
    tenant = state.tenant_of(request)
    formatter = state.formatter
    prompt, images = formatter.render_prompt(chat, tenant)
    check_count([s.image for s in images], state.image_policy)
    params.grammar = formatter.grammar(chat)
    if state.script is not None:
        params.forced_ids = state.script.forced_ids(chat, formatter.parser, state.engine)
    prep = prepare_ids(state, request, prompt, params, tenant, explicit_max, images)
    formatter.check_continuity(chat, tenant, prompt, params.session)
    return prep._replace(ignored_tools=tuple(chat.ignored_tools))


def prepare_ids(
    state: ServerState,
    request: Request,
    prompt: list[int],
    params: SamplingParams,
    tenant: str,
    explicit_max: bool = True,
    images: tuple[ImageSpan, ...] = (),
) -> Prepared:
    """The checks and output budget of a rendered prompt (raw completions start here)."""
    check_prompt(state, prompt)
    is_capped = cap_output(state, params)
    strict = state.strict_max_tokens and explicit_max
    context = state.engine_limits.max_context
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
    check_params(state, params)
    return Prepared(prompt, params, tenant, is_capped, images, fit.clamped_from)


def check_prompt(state: ServerState, prompt: list[int]) -> None:
    """The server's own prompt limit (--max-prompt-tokens); the context is the engine's one
    check (``serving.context``), an empty prompt too."""
    cap = state.limits.max_prompt_tokens
    if cap and len(prompt) > cap:
        raise PromptTooLongError(
            f"the prompt has {len(prompt)} tokens; this server takes at most {cap} per "
            "request (--max-prompt-tokens)",
            len(prompt),
            cap,
        )


def check_params(state: ServerState, params: SamplingParams) -> None:
    """Stop-string limits and the time budget; then the engine's own checks."""
    lim = state.limits
    if len(params.stop) > lim.max_stop_strings:
        raise RequestError(
            f"at most {lim.max_stop_strings} stop strings per request, not {len(params.stop)}"
        )
    if any(len(s) > lim.max_stop_chars for s in params.stop):
        raise RequestError(f"a stop string may have at most {lim.max_stop_chars} characters")
    params.timeout_s = lim.request_timeout_s
    params.validate()


def cap_output(state: ServerState, params: SamplingParams) -> bool:
    """Apply --max-output-tokens; True when it lowered the client's max_tokens."""
    if not state.max_output_tokens or params.max_tokens <= state.max_output_tokens:
        return False
    params.max_tokens = state.max_output_tokens
    return True
