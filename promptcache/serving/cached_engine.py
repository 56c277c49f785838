"""The engine the server talks to: a model runner, the prompt cache, and the scheduler that
shares one between requests. Built explicitly: the runner first (it knows the model's
fingerprint, layout and codec), then the cache from it, then the request steps and the scheduler.

``TorchEngine`` and ``MlxEngine`` are this class on their library's runner, with the
constructors and ``load`` the CLI, benchmarks and tests use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from promptcache.core.admin import CacheAdmin
from promptcache.core.codec import PayloadCodec
from promptcache.core.figures import Figures, Joined, Series, Snapshot
from promptcache.core.images import ImageInput, ImageSpan
from promptcache.core.lease import Lease
from promptcache.core.sequence import TokenSeq
from promptcache.core.worker_threads import start_thread
from promptcache.errors import RequestError
from promptcache.serving.admission import Admission
from promptcache.serving.batching import DEFAULT_STEP_TOKENS, MAX_STEP_TOKENS, Batcher
from promptcache.serving.block_scheme import quant_stats
from promptcache.serving.cache_setup import EngineOptions, build_cache, build_vision_cache
from promptcache.serving.context import check_prompt_fits
from promptcache.serving.events import EngineLimits, Event, Finished, SamplingParams
from promptcache.serving.forced import ForcedTokens, TokenConstraint
from promptcache.serving.grammar import GrammarConstraint, build_ll_tokenizer, hf_tokenizer_of
from promptcache.serving.layers import Layout
from promptcache.serving.memory_books import MemoryBooks
from promptcache.serving.request import Request
from promptcache.serving.runner import ComputeFigures, ModelRunner, WarmsUp
from promptcache.serving.scheduler import Scheduler
from promptcache.serving.steps import Steps
from promptcache.serving.vision import VisionFeeder, VisionModel

log = logging.getLogger("promptcache")


class CachedEngine:
    """``Engine`` on a ``ModelRunner``: ``options`` are ``EngineOptions``' fields."""

    name = "engine"

    def __init__(self, runner: ModelRunner, **options: Any) -> None:
        opts = EngineOptions.of(**options)
        opts.check()
        self.runner = runner
        self.options = opts
        self.model_id = opts.model_id
        self.prefill_chunk = opts.prefill_chunk
        limit = runner.model_limit
        # load_weights applied (RoPE scaling raises model_limit) or refused a larger max_context;
        # one reaching here came with a model loaded without it: capped, and said so
        self.max_context = min(opts.max_context or limit, limit)
        if opts.max_context and opts.max_context > limit:
            log.warning(
                "max_context %d is above the model's context of %d tokens: capped (load the model "
                "with load_weights(..., max_context=%d) to extend it)",
                opts.max_context,
                limit,
                opts.max_context,
            )
        self.cache = build_cache(
            opts, runner.fingerprint, runner.codec(), runner.layout.requires_checkpoint
        )
        self._admin = CacheAdmin(self.cache) if self.cache is not None else None
        # a vision-language runner's image half (None: a text-only model)
        self.vision: VisionModel | None = getattr(runner, "vision", None)
        self.feeder: VisionFeeder | None = None
        if self.vision is not None:
            cache = build_vision_cache(opts, runner.codec())
            self.feeder = VisionFeeder(self.vision, runner.fingerprint, cache)
        self.steps = Steps(
            runner,
            self.cache,
            prefill_chunk=opts.prefill_chunk,
            max_context=self.max_context,
            decode_text=self.decode,
            feeder=self.feeder,
        )
        # the token budget per step: one-token steps first, prefill chunks in the rest
        self.batcher = Batcher(
            self.steps,
            opts.step_tokens or DEFAULT_STEP_TOKENS,
            min_shared=opts.block_size,
            max_step_tokens=opts.max_step_tokens or MAX_STEP_TOKENS,
        )
        # a newcomer waits while the running requests' state leaves no room for its prompt
        self.admission = Admission(runner, self.steps)
        self.scheduler = Scheduler(
            self.batcher,
            self.cache.check_integrity if self.cache is not None else None,
            self.admission.admits,
        )
        # before the books take the process's RSS at start
        if opts.warm_up and isinstance(runner, WarmsUp):
            self._warm_up(runner)
        self.admission.set_cap(opts.max_live_bytes, self.cache)  # from the memory left now
        self.books = MemoryBooks(self.cache, self.runner, self.scheduler)
        self.heap = self.books.heap  # when freed memory goes back (idle, or RSS too high)
        # a step's first tokens go out before its decode forward
        self.batcher.on_events = self.scheduler.deliver
        self._ll_tokenizer: Any = None  # built on the first constrained request
        # special tokens decode() keeps (a tool-call or reasoning format's markers); None: none
        self._hidden: set[int] | None = None

    def _warm_up(self, runner: WarmsUp) -> None:
        """``runner.warm_up_steps`` on a thread started as the stepping thread is (its torch
        threads: oneDNN keeps a primitive per thread count); a failure is logged, not raised
        (the first requests build what it did not)."""
        start, done = time.monotonic(), []

        def run() -> None:
            try:
                done.append(runner.warm_up_steps(self.batcher.step_tokens,
                                                 self.batcher.max_step_tokens))  # fmt: skip
            except Exception as exc:
                log.warning(
                    "warming up the step shapes failed (%r): the first steps build them", exc
                )

        start_thread(run, "promptcache-warm-up").join()
        if done:
            log.info("warmed up %d step shapes in %.1f s", done[0], time.monotonic() - start)

    # -- what the runner knows (read by the server, tests and benchmarks) -----------------------

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.runner.fingerprint

    @property
    def layout(self) -> Layout:
        return self.runner.layout

    @property
    def model_type(self) -> str:
        """The config's model_type ("" when the runner's model has none)."""
        model = self.runner.model
        config = getattr(model, "config", None)
        return str(getattr(config, "model_type", "") or getattr(model, "model_type", "") or "")

    @property
    def eos_ids(self) -> set[int]:
        return self.runner.eos_ids

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        return self.runner.rope_scaling

    @property
    def limits(self) -> EngineLimits:
        block = self.cache.block_size if self.cache is not None else None
        return EngineLimits(self.max_context, self.vocab_size, block, self.supports_images)

    @property
    def cache_admin(self) -> CacheAdmin | None:
        return self._admin

    # -- one sequence on the model, outside the scheduler (tests, benchmarks' ideal runs) -------

    def new_state(self) -> Any:
        return self.runner.new_state()

    def forward(self, state: Any, ids: list[int]) -> Any:
        """Run ``ids`` on ``state``; the last position's logits. Not scheduled: only for a
        state no request holds, on an engine nobody else is using."""
        return self.runner.forward([state], [ids])[0]

    def crop(self, state: Any, length: int) -> None:
        self.runner.crop(state, length)

    def to_numpy(self, logits: Any) -> np.ndarray:
        return self.runner.to_numpy(logits)

    def codec(self) -> PayloadCodec:
        return self.runner.codec()

    # -- prompts --------------------------------------------------------------------------------

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False,
                **template_kwargs,
            )  # fmt: skip
        except Exception as exc:  # template errors are the client's (bad roles, bad tool shapes)
            raise RequestError(f"cannot apply the chat template: {exc}") from exc
        return self.encode_text(text, special=False)

    @property
    def supports_images(self) -> bool:
        return self.vision is not None

    def encode_chat_images(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: list[ImageInput],
    ) -> tuple[list[int], list[ImageSpan]]:
        """Prompt ids and image spans of a chat with ``{"type": "image"}`` content parts
        (``images`` in their order); RequestError on a text-only model."""
        if self.vision is None:
            raise RequestError("this server's model takes no image input (text only)")
        return self.vision.render(messages, tools, images)

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") from JSON
            raise RequestError(
                f"the text has an invalid character at position {exc.start} "
                f"({text[exc.start]!r}, an unpaired surrogate)"
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        if self._hidden is None:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        kept = [i for i in ids if i not in self._hidden]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def show_special_tokens(self, texts: set[str]) -> None:
        """Make decode() keep the special tokens spelled ``texts`` (harmony's ``<|channel|>``,
        Kimi's call markers), which the reply's parser reads; other special tokens and the
        end-of-sequence ones stay skipped. Call before serving (replies read it per token)."""
        tok = hf_tokenizer_of(self.tokenizer)
        decoder = getattr(tok, "added_tokens_decoder", None) or {}
        specials = {i for i, t in decoder.items() if getattr(t, "special", False)}
        specials |= set(getattr(tok, "all_special_ids", None) or [])
        added = {str(t): i for i, t in decoder.items()}
        shown = {added[t] for t in texts if t in added} - set(self.eos_ids)
        if shown & specials:
            self._hidden = (specials - shown) | set(self.eos_ids)

    # -- requests -------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        cancel: threading.Event | None = None,
        images: tuple[ImageSpan, ...] | list[ImageSpan] = (),
    ) -> Iterator[Event]:
        t0 = time.perf_counter()
        params.validate()
        constraint: TokenConstraint | None = None
        if params.forced_ids:  # a scripted reply wins over any grammar
            constraint = ForcedTokens(params.forced_ids)
        elif params.grammar:
            constraint = self.make_constraint(params.grammar)
        if cancel is not None and cancel.is_set():  # the client left while queued
            yield Finished("cancelled", 0, 0, 0, "")
            return
        self._check_prompt(prompt_ids, images)
        deadline = None if params.timeout_s is None else time.monotonic() + params.timeout_s
        req = Request(list(prompt_ids), params, tenant, cancel, constraint, deadline, t0)
        req.images = tuple(images)
        yield from self.scheduler.events(req)

    def _check_prompt(self, prompt_ids: list[int], images: Any = ()) -> None:
        if images and self.vision is None:
            raise RequestError("this server's model takes no image input (text only)")
        if any(s.start < 0 or s.end > len(prompt_ids) for s in images):
            raise RequestError("an image span lies outside the prompt")
        check_prompt_fits(len(prompt_ids), self.max_context)

    def prefill(
        self,
        prompt_ids: list[int],
        tenant: str = "",
        images: tuple[ImageSpan, ...] | list[ImageSpan] = (),
    ) -> tuple[Any, Any, Lease | None, TokenSeq | None]:
        """The whole prompt in one turn: restore the longest cached prefix, prefill the rest in
        chunks (saving at each boundary). Returns the state, last-token logits, the pinned lease
        (release it when done) and the sequence. For tests and benchmarks: no events."""
        self._check_prompt(prompt_ids, images)
        req = Request(list(prompt_ids), SamplingParams(), tenant)
        req.images = tuple(images)
        with self.scheduler.turns.step():
            try:
                self.steps.begin(req)
                while req.pos < req.num_prompt:
                    self.steps.prefill_chunk_of(req)
            except BaseException:
                req.release()
                raise
        return req.state, req.logits, req.lease, req.seq

    def make_constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh grammar state for one request (raises RequestError on a bad grammar)."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.eos_ids)
        return GrammarConstraint(self._ll_tokenizer, grammar)

    def forget_images(self, tenant: str, session: str | None, force: bool = False) -> int:
        return self.feeder.forget(tenant, session, force) if self.feeder is not None else 0

    def memory_stats(self) -> dict[str, int]:
        """Where the process's memory is (``MemoryBooks.stats``)."""
        return self.books.stats(self.max_live_bytes or 0)

    @property
    def max_live_bytes(self) -> int | None:
        """The cap on the running requests' state (``Admission``); None: none."""
        return self.admission.max_live_bytes

    def cache_figures(self) -> dict[str, Figures]:
        """The prompt cache's figures by family (``cache``, ``memory``, ``compute``, ``vision``);
        empty when the cache is off. Each is taken consistently on its own."""
        if self.cache is None:
            return {}
        stats = self.cache.stats()
        parts: list[Figures] = [stats, self.batcher.stats(), self.scheduler.stats()]
        # the runner's block packer, when blocks are stored quantized or narrower (block_scheme)
        parts.append(quant_stats(self.runner.packer, stats.bytes_by_tier["ram"]))
        memory = self.memory_stats()
        out: dict[str, Figures] = {
            "cache": Joined(tuple(parts)),
            "memory": Snapshot(memory, tuple(Series(k, "gauge", v) for k, v in memory.items())),
        }
        if isinstance(self.runner, ComputeFigures):  # threads in force (a core given up?)
            out["compute"] = self.runner.compute_stats()
        if self.feeder is not None:  # encoder runs and the vision-embedding cache
            out["vision"] = self.feeder.stats()
        return out

    def cache_stats(self) -> dict[str, Any]:
        figures = self.cache_figures()
        if not figures:
            return {}
        out = figures.pop("cache").to_dict()
        out.update({family: f.to_dict() for family, f in figures.items()})
        return out

    def cache_series(self) -> list[Series]:
        return [
            s.renamed(f"{family}_")
            for family, f in self.cache_figures().items()
            for s in f.series()
        ]

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
