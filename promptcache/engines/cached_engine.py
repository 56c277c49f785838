"""What every engine shares: chunked prefill that reuses and feeds the prompt cache, then decode.

An engine subclass supplies the model-specific steps (its cache object, one forward pass, block
slices, checkpoints, restore); this class owns the cache protocol around them, so torch and MLX
serve the same hits, save at the same points and stream the same events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from promptcache.core.budget import parse_size
from promptcache.core.cache import Lease, PromptCache
from promptcache.core.codec import PayloadCodec
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_tier import SsdTier
from promptcache.engines.base import (
    EngineError,
    EngineTimeoutError,
    Event,
    Finished,
    PrefillDone,
    PromptTooLongError,
    SamplingParams,
)
from promptcache.engines.decoding import decode_reply
from promptcache.engines.grammar import GrammarConstraint, build_ll_tokenizer
from promptcache.engines.turns import FairTurns, StepTimeout


@dataclass(slots=True)
class _Running:
    """One request on the engine between its steps."""

    prompt: list[int]
    seq: TokenSeq | None = None
    lease: Lease | None = None
    state: Any = None
    logits: Any = None
    pos: int = 0  # prompt tokens in ``state``

    @property
    def cached(self) -> int:
        return self.lease.num_tokens if self.lease is not None else 0


class Layout(Protocol):
    @property
    def requires_checkpoint(self) -> bool:
        """True when some layer's state is snapshot state (restorable only at checkpoints)."""

    @property
    def has_positional(self) -> bool:
        """True when some layer's state is sliced per block."""


class CachedEngine:
    """Subclasses set ``model``, ``tokenizer``, ``layout``, ``fingerprint``, ``max_context``,
    ``eos_ids`` and call ``_init_cache``; then implement the six model steps below."""

    name = "engine"
    layout: Layout

    # -- model steps (subclass) -----------------------------------------------------------------

    def new_state(self) -> Any:
        """An empty per-request model cache."""
        raise NotImplementedError

    def forward(self, state: Any, ids: list[int]) -> Any:
        """Run ``ids`` through the model, appending to ``state``; last position's logits."""
        raise NotImplementedError

    def slice_block(self, state: Any, start: int, end: int) -> Any:
        """An owning copy of the positional state for positions [start, end)."""
        raise NotImplementedError

    def take_checkpoint(self, state: Any) -> Any:
        """A copy of the snapshot state at the current position; None without snapshot layers."""
        raise NotImplementedError

    def restore(self, segments: list[tuple[Any, int]], checkpoint: Any) -> Any:
        """A fresh state holding a hit: block payloads (with tokens used) and the checkpoint."""
        raise NotImplementedError

    def crop(self, state: Any, length: int) -> None:
        """Cut the positional state back to ``length`` (only called without snapshot layers)."""
        raise NotImplementedError

    def to_numpy(self, logits: Any) -> np.ndarray:
        raise NotImplementedError

    def codec(self) -> PayloadCodec:
        """How this engine's payloads travel to block files."""
        raise NotImplementedError

    # -- set-up ---------------------------------------------------------------------------------

    @staticmethod
    def load_weights(
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_context: int | None = None,
    ) -> tuple[Any, Any]:
        """(model, tokenizer) from a model folder, shareable between engines of this kind. A
        ``max_context`` above the model's native context loads it with YaRN RoPE scaling, or
        raises ``promptcache.models.ContextExtensionError`` when the model cannot be extended."""
        raise NotImplementedError

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **options: Any
    ) -> Any:
        """An engine on the model in ``path``; ``options`` as for ``_init_cache`` (and the
        engine's own keyword arguments). The model id defaults to the folder name."""
        path = Path(path)
        model, tokenizer = cls.load_weights(
            path, dtype=dtype, device=device, max_context=options.get("max_context")
        )
        return cls(model, tokenizer, model_id=options.pop("model_id", path.name), **options)

    def _init_cache(
        self,
        tokenizer: Any,
        *,
        model_limit: int,
        model_id: str = "model",
        cache: PromptCache | None = None,
        cache_enabled: bool = True,
        block_size: int = 64,
        ram_budget: int | str | None = None,
        prefill_chunk: int = 512,
        max_context: int | None = None,
        next_tier: Any = None,
        policy: str | None = None,
        ssd_dir: str | Path | None = None,
        ssd_budget: int | str = "10GB",
        ssd_retention: float | None = None,
    ) -> None:
        """Serving and cache options shared by every engine. ``cache``: an existing cache to
        use; else one is built (``cache_enabled``) with a RAM tier of ``ram_budget`` and, with
        ``ssd_dir``, an SSD tier behind it. ``max_context`` is capped at ``model_limit``."""
        if prefill_chunk <= 0:
            raise ValueError("prefill_chunk must be positive")
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.prefill_chunk = prefill_chunk
        # load_weights applied (RoPE scaling raises model_limit) or refused a larger max_context;
        # one reaching here came with a model loaded without it: capped, and said so
        self.max_context = min(max_context or model_limit, model_limit)
        if max_context and max_context > model_limit:
            import logging

            logging.getLogger("promptcache").warning(
                "max_context %d is above the model's context of %d tokens: capped (load the model "
                "with load_weights(..., max_context=%d) to extend it)",
                max_context,
                model_limit,
                max_context,
            )
        if cache is None and cache_enabled and next_tier is None and ssd_dir is not None:
            next_tier = SsdTier(
                ssd_dir,
                self.fingerprint,
                codec=self.codec(),
                budget_bytes=parse_size(ssd_budget),
                retention_s=ssd_retention,
            )
        if cache is None and cache_enabled:
            cache = PromptCache(
                self.fingerprint,
                block_size=block_size,
                ram_budget=ram_budget,
                requires_checkpoint=self.layout.requires_checkpoint,
                next_tier=next_tier,
                policy=policy,
            )
        self.cache = cache
        self.turns = FairTurns()  # one step (prefill chunk or token) at a time, FIFO
        # the last request's live state and the sequence it covers: a hit that it also covers is
        # served from it directly (bitwise the same state as restoring the blocks, minus the copy)
        self._live: tuple[Any, TokenSeq] | None = None
        self._ll_tokenizer: Any = None  # built on the first constrained request

    # -- prompts --------------------------------------------------------------------------------

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # template errors are the client's (bad roles, bad tool shapes)
            raise EngineError(f"cannot apply the chat template: {exc}") from exc
        return self.encode_text(text, special=False)

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") from JSON
            raise EngineError(
                f"the text has an invalid character at position {exc.start} "
                f"({text[exc.start]!r}, an unpaired surrogate)"
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- the cache protocol ---------------------------------------------------------------------

    def _save(self, seq: TokenSeq, state: Any, num_tokens: int) -> None:
        assert self.cache is not None
        self.cache.save(
            seq,
            num_tokens,
            (lambda s, e: self.slice_block(state, s, e)) if self.layout.has_positional else None,
            self.take_checkpoint(state),
        )

    def _reuse_live(self, seq: TokenSeq, hit: int) -> Any:
        if self._live is None:
            return None
        state, live = self._live
        if (
            live.root != seq.root
            or live.num_tokens < hit
            or live.block_bytes(0, hit) != seq.block_bytes(0, hit)
        ):
            return None
        if live.num_tokens != hit:
            if self.layout.requires_checkpoint:  # recurrent state cannot be rewound
                return None
            self.crop(state, hit)
        return state

    def _begin(self, prompt_ids: list[int], tenant: str) -> _Running:
        """Look the prompt up and restore the longest cached prefix (pinned until released)."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineError("the prompt is empty")
        if n >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this server's context is {self.max_context} tokens",
                n,
                self.max_context,
            )
        run = _Running(prompt_ids)
        if self.cache is not None:
            run.seq = self.cache.sequence(prompt_ids, tenant=tenant)
            run.lease = self.cache.lookup(run.seq)
            if run.lease.num_tokens:
                try:
                    run.state = self._reuse_live(run.seq, run.lease.num_tokens)
                    if run.state is None:
                        run.state = self.restore(run.lease.segments(), run.lease.checkpoint)
                except BaseException:
                    run.lease.release()
                    raise
                run.pos = run.lease.num_tokens
        self._live = None  # the live state is now this request's (or stale)
        if run.state is None:
            run.state = self.new_state()
        return run

    def _prefill_chunk(self, run: _Running) -> None:
        """One prefill step: the next chunk, saved at its end."""
        end = min(len(run.prompt), (run.pos // self.prefill_chunk + 1) * self.prefill_chunk)
        run.logits = self.forward(run.state, run.prompt[run.pos : end])
        run.pos = end
        if run.seq is not None:
            self._save(run.seq, run.state, run.pos)

    def prefill(
        self, prompt_ids: list[int], tenant: str = ""
    ) -> tuple[Any, Any, Lease | None, TokenSeq | None]:
        """The whole prompt in one turn: restore the longest cached prefix, prefill the rest in
        chunks (saving at each boundary). Returns the state, last-token logits, the pinned lease
        (release it when done) and the sequence."""
        with self.turns.step():
            run = self._begin(prompt_ids, tenant)
            try:
                while run.pos < len(prompt_ids):
                    self._prefill_chunk(run)
            except BaseException:
                if run.lease is not None:
                    run.lease.release()
                raise
        return run.state, run.logits, run.lease, run.seq

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        params.validate()
        t0 = time.perf_counter()
        constraint = self.make_constraint(params.grammar) if params.grammar else None
        deadline = None if params.timeout_s is None else time.monotonic() + params.timeout_s

        def step() -> Any:  # one turn on the engine, or StepTimeout once the deadline passes
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StepTimeout
            return self.turns.step(left)

        def is_cancelled() -> bool:
            return cancel is not None and cancel.is_set()

        n = len(prompt_ids)
        run: _Running | None = None
        try:
            try:
                if is_cancelled():  # the client left while queued: no prompt was looked at
                    yield Finished("cancelled", 0, 0, 0, "")
                    return
                with step():
                    run = self._begin(prompt_ids, tenant)
                while run.pos < n:
                    if is_cancelled():  # nobody waits for this prefill any more
                        yield Finished("cancelled", n, 0, run.cached, "")
                        return
                    with step():
                        self._prefill_chunk(run)
            except StepTimeout:
                raise EngineTimeoutError(
                    f"the request did not get through prefill within its time budget "
                    f"({params.timeout_s:g} s); the server is busy, try again later"
                ) from None
            yield PrefillDone(
                n,
                run.cached,
                time.perf_counter() - t0,
                run.lease.kind if run.lease else "off",
                run.lease.report if run.lease else None,
            )
            fin = None
            for ev in decode_reply(
                self, run.state, run.logits, n, run.cached, params, constraint, step, is_cancelled
            ):
                fin = ev if isinstance(ev, Finished) else None
                yield ev
            assert fin is not None
            generated, reason = fin.completion_ids, fin.reason
            # after the reply: feed the last sampled token so the saved state covers prompt +
            # every generated token, and the next turn hits the assistant's reply too
            if (
                run.seq is not None
                and generated
                and reason not in ("cancelled", "timeout")
                and n + len(generated) < self.max_context
            ):
                with self.turns.step():
                    self.forward(run.state, [generated[-1]])
                    full = run.seq.extend(generated)
                    self._save(full, run.state, n + len(generated))
                    self._live = (run.state, full)
        finally:
            if run is not None and run.lease is not None:
                run.lease.release()

    def make_constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh grammar state for one request (raises EngineError on a bad grammar)."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.eos_ids)
        return GrammarConstraint(self._ll_tokenizer, grammar)

    def cache_stats(self) -> dict[str, Any]:
        return self.cache.stats().to_dict() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
