"""What one step does to one request: its lookup and restore, one prefill chunk (saved at its
end), one decoded token (batched: ``one_token_steps``), or the final save of prompt + reply. Which
requests step, and when, is the scheduler's; everything here runs inside a step, so the model
and the live slot are ours. Each step returns what happened (a ``Moved``: where the request goes
next and the events for its consumer); the scheduler alone moves ``Request.phase`` and fills
``Request.outbox``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from promptcache.core.cache import PromptCache
from promptcache.core.images import image_extras
from promptcache.core.sequence import TokenSeq
from promptcache.errors import CacheSaveError, EngineTimeoutError, RequestError
from promptcache.serving.decoding import emit_token, finish_reply, sample_after, start_decoding
from promptcache.serving.events import Event, Finished, PrefillDone
from promptcache.serving.request import Moved, Phase, Request
from promptcache.serving.runner import ModelRunner, PackedRunner
from promptcache.serving.vision import VisionFeeder, image_safe_end


class Steps:
    """The engine's work on a request, one step at a time (the scheduler's ``Work``)."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: PromptCache | None,
        *,
        prefill_chunk: int,
        max_context: int,
        decode_text: Callable[[list[int]], str],
        feeder: VisionFeeder | None = None,
    ) -> None:
        self.runner = runner
        self.feeder = feeder  # image rows for chunks holding image tokens (vision models)
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self.decode_text = decode_text
        # the last request's live state and the sequence it covers: a hit that it also covers is
        # served from it directly (bitwise the same state as restoring the blocks, minus the copy)
        self.live: tuple[Any, TokenSeq] | None = None
        self.checkpoint_last = True  # see chunk_end (off: only chunk and prompt ends, to compare)
        # several requests' new tokens in one forward, where the runner can (``packed_step``)
        self._packed = runner if isinstance(runner, PackedRunner) else None

    # -- one request's part of a step (``batching.Batcher`` composes the step) ------------------

    def chunk_end(self, req: Request) -> int:
        """Where the next prefill chunk ends: the next multiple of ``prefill_chunk`` (chunks stay
        aligned however the steps are composed, so checkpoints land on the same positions).
        A model with snapshot layers stops one token short of the prompt's end first: the
        checkpoint saved there (``is_save_point``) lets a repeat or a regenerate reuse all but
        the last token, whose logits are always computed, as an attention model does."""
        end = min(req.num_prompt, (req.pos // self.prefill_chunk + 1) * self.prefill_chunk)
        end = self._image_safe(req, end)
        if end == req.num_prompt and req.pos < end - 1 and self._checkpoints_last(req):
            return end - 1
        return end

    def _image_safe(self, req: Request, end: int) -> int:
        """``end`` past the image it would cut, for a model whose image tokens attend to each
        other (``VisionModel.whole_images``): such an image is prefilled in one forward."""
        if req.images and self.feeder is not None and self.feeder.vision.whole_images:
            return image_safe_end(req.images, end)
        return end

    def _moved_to(self, req: Request, end: int) -> bool:
        """Whether ``end`` is the end of a whole image a chunk boundary was moved to (saved as
        that boundary would have been)."""
        if not req.images or self.feeder is None or not self.feeder.vision.whole_images:
            return False
        last_boundary = (end - 1) // self.prefill_chunk * self.prefill_chunk
        return any(s.end == end and last_boundary > s.start for s in req.images)

    def _checkpoints_last(self, req: Request) -> bool:
        return (
            self.checkpoint_last and req.seq is not None and self.runner.layout.requires_checkpoint
        )

    def is_save_point(self, req: Request, end: int) -> bool:
        """Whether the state at ``end`` is saved: a chunk's end, the prompt's, and for snapshot
        layers the prompt's last computed position (its end minus the last token)."""
        if req.seq is None:
            return False
        n = req.num_prompt
        return (
            end % self.prefill_chunk == 0
            or end == n
            or (end == n - 1 and self._checkpoints_last(req))
            or self._moved_to(req, end)
        )

    @property
    def has_cache(self) -> bool:
        return self.cache is not None

    @property
    def can_split_chunks(self) -> bool:
        """Whether a prefill chunk may run in smaller pieces without changing the saved state's
        numerics beyond float noise: attention-only layouts (an SSM's chunked scan would)."""
        return not self.runner.layout.requires_checkpoint

    def begin_step(self, req: Request) -> Moved:
        """A new request's lookup and restore: it prefills next."""
        self.begin(req)
        return Moved(Phase.PREFILL)

    def prefill_step(self, req: Request, end: int | None = None) -> Moved:
        """Prefill up to ``end`` (default: the chunk's end); the prompt's last piece sends
        PrefillDone and the first token."""
        self.prefill_chunk_of(req, end)
        return self._after_piece(req)

    def _after_piece(self, req: Request) -> Moved:
        """A prompt not done prefills on; at its end: PrefillDone and the first token."""
        if req.pos < req.num_prompt:
            return Moved(Phase.PREFILL)
        report = req.lease.report if req.lease is not None else None
        t = time.perf_counter()
        events: list[Event] = [
            PrefillDone(req.num_prompt, req.cached, t - req.t0, req.hit_kind, report, req.phases)
        ]
        scores = self.runner.to_numpy(req.logits)
        start_decoding(req, self.max_context, self.decode_text, scores)
        moved = self._token(req, events)  # the first token costs no forward: the prompt's logits
        req.phases.first_token_s = time.perf_counter() - t
        return moved

    def decode_step(self, req: Request, logits: Any) -> Moved:
        """The token after the one the forward just fed (``logits`` are its row)."""
        sample_after(req, self.runner.to_numpy(logits))
        return self._token(req, [])

    def one_token_steps(self, reqs: list[Request], is_save: list[bool]) -> tuple[list[Moved], bool]:
        """One forward feeding each request its last sampled token (batched where the runner
        can), then each one's next token, or its final save where ``is_save``. Returns the
        outcomes in order and whether the forward was batched. A failed forward fails them all."""
        runner = self.runner
        batched = runner.batches_decode([r.state for r in reqs])
        try:
            logits = runner.forward([r.state for r in reqs], [[r.generated[-1]] for r in reqs])
        except Exception as exc:  # the batch's forward: every request in it fails
            return [Moved(exc)] * len(reqs), batched
        out = [
            _attempt(self.save_reply, req) if save else _attempt(self.decode_step, req, row)
            for req, row, save in zip(reqs, logits, is_save, strict=True)
        ]
        return out, batched

    def packs(self, reqs: Sequence[Request]) -> bool:
        """Whether ``packed_step`` can run these requests' next tokens in one forward: the
        runner packs their states (``PackedRunner``) and no prompt among them has images (its
        chunks go through the vision model's forward; a request begun in this step is still
        ``NEW``, so its phase cannot tell)."""
        packed = self._packed
        return (
            packed is not None
            and not any(r.images for r in reqs)
            and packed.packs([r.state for r in reqs])
        )

    def packed_step(
        self, pieces: Sequence[tuple[Request, int]], one: Sequence[Request], is_save: Sequence[bool]
    ) -> list[Moved]:
        """Every prefill piece (its request's prompt up to ``end``: saved at a save point, the
        prompt's last piece sends PrefillDone and the first token) and every one-token step (as
        ``one_token_steps``) in one forward (``packs`` said so): the outcomes, pieces first, in
        order. A failed forward fails them all."""
        assert self._packed is not None
        reqs = [r for r, _ in pieces] + list(one)
        ids = [r.prompt[r.pos : end] for r, end in pieces] + [[r.generated[-1]] for r in one]
        t = time.perf_counter()
        try:
            logits = self._packed.forward_packed([r.state for r in reqs], ids)
        except Exception as exc:  # the packed forward: every request in it fails
            return [Moved(exc)] * len(reqs)
        seconds = time.perf_counter() - t  # each piece waited for the whole forward
        out = [
            _attempt(self._piece_done, req, end, row, seconds)
            for (req, end), row in zip(pieces, logits[: len(pieces)], strict=True)
        ]
        for req, row, save in zip(one, logits[len(pieces) :], is_save, strict=True):
            out.append(
                _attempt(self.save_reply, req) if save else _attempt(self.decode_step, req, row)
            )
        return out

    def _piece_done(self, req: Request, end: int, logits: Any, seconds: float) -> Moved:
        self._prefilled(req, end, logits, seconds)
        return self._after_piece(req)

    def time_out(self, req: Request) -> Moved:
        """The deadline passed: before the first token the request fails (503), after it the
        reply ends with reason "timeout"."""
        if req.is_started:
            return self._finish(req, "timeout", [])
        timeout_s = req.params.timeout_s or 0.0
        return Moved(
            EngineTimeoutError(
                f"the request did not get through prefill within its time budget "
                f"({timeout_s:g} s); the server is busy, try again later"
            )
        )

    def cancel(self, req: Request) -> Moved:
        """Nobody waits for the reply any more: end it now (a queued request never looked its
        prompt up; after Finished the final save still runs)."""
        if req.phase is Phase.NEW:
            return Moved(Phase.DONE, [Finished("cancelled", 0, 0, 0, "")])
        if req.phase in (Phase.PREFILL, Phase.DECODE):
            return self._finish(req, "cancelled", [])
        return Moved(req.phase)

    # -- building blocks (``CachedEngine.prefill`` uses them too) -------------------------------

    def begin(self, req: Request) -> None:
        """Look the prompt up and restore the longest cached prefix (pinned until released)."""
        phases, t = req.phases, time.perf_counter()
        phases.queued_s = t - req.t0
        if self.cache is not None:
            try:
                req.seq = self.cache.sequence(
                    req.prompt,
                    tenant=req.tenant,
                    session=req.params.session,
                    ttl_s=req.params.cache_ttl_s,
                    extras=image_extras(req.images, self.cache.block_size) if req.images else None,
                )
            except ValueError as exc:  # token ids the cache cannot key: the client's input
                raise RequestError(f"prompt: {exc}") from None
            req.lease = self.cache.lookup(req.seq)
            t1 = time.perf_counter()
            phases.lookup_s = t1 - t
            if req.lease.num_tokens:
                req.state = self.reuse_live(req.seq, req.lease.num_tokens)
                if req.state is None:
                    req.state = self.runner.restore(
                        req.lease.segments(), req.lease.checkpoint, req.num_prompt
                    )
                req.pos = req.lease.num_tokens
            phases.restore_s = time.perf_counter() - t1
        self.live = None  # the live state is now this request's (or stale)
        if req.state is None:
            req.state = self.runner.new_state(req.num_prompt)

    def prefill_chunk_of(self, req: Request, end: int | None = None) -> None:
        """The next chunk (up to the next multiple of ``prefill_chunk``) or a piece of it (up to
        ``end``), saved at a chunk's end or the prompt's."""
        end = self.chunk_end(req) if end is None else self._image_safe(req, end)
        ids = req.prompt[req.pos : end]
        t = time.perf_counter()
        if req.images:
            if self.feeder is None:
                raise RequestError("this server's model takes no image input")
            logits = self.feeder.forward_chunk(
                req.state, ids, req.pos, req.images, req.features, req.tenant, req.params.session
            )
        else:  # a prompt without images: the plain text forward
            logits = self.runner.forward([req.state], [ids])[0]
        self._prefilled(req, end, logits, time.perf_counter() - t)

    def _prefilled(self, req: Request, end: int, logits: Any, seconds: float) -> None:
        """A piece's forward ran (``seconds``): its logits and position, saved at a save point."""
        req.logits = logits
        req.pos = end
        t1 = time.perf_counter()
        req.phases.prefill_s += seconds
        req.phases.num_forwards += 1
        if req.seq is not None and self.is_save_point(req, end):
            self.save(req.seq, req.state, req.pos)
            req.phases.save_s += time.perf_counter() - t1

    def final_save(self, req: Request) -> Moved:
        """Feed the last sampled token so the saved state covers prompt + every generated token:
        the next turn hits the assistant's reply too. The state stays live for that turn."""
        self.runner.forward([req.state], [[req.generated[-1]]])
        return self.save_reply(req)

    def save_reply(self, req: Request) -> Moved:
        """The final save, once the last token has been fed (alone or in a batched forward)."""
        assert req.seq is not None
        full = req.seq.extend(req.generated)
        self.save(full, req.state, req.num_prompt + len(req.generated))
        # kept for the next turn: its own copy, not a view holding a whole decode batch alive
        self.live = (self.runner.compact(req.state), full)
        return Moved(Phase.DONE)

    def save(self, seq: TokenSeq, state: Any, num_tokens: int) -> None:
        assert self.cache is not None
        runner = self.runner
        slicer = (
            (lambda s, e: runner.slice_block(state, s, e)) if runner.layout.has_positional else None
        )
        try:
            self.cache.save(seq, num_tokens, slicer, runner.take_checkpoint(state))
        except ValueError as exc:  # e.g. a block larger than the RAM budget: ours, not the client's
            raise CacheSaveError(f"the prompt cache refused a save: {exc}") from exc

    def reuse_live(self, seq: TokenSeq, hit: int) -> Any:
        """The live state when it covers the hit's tokens exactly (cropped back to the hit), else
        None. Recurrent state cannot be rewound: then only an exact cover is reused."""
        if self.live is None:
            return None
        state, live = self.live
        if (
            live.root != seq.root
            or live.num_tokens < hit
            or live.block_bytes(0, hit) != seq.block_bytes(0, hit)
            or not live.same_extras(seq, hit)  # the same placeholder tokens, another image
        ):
            return None
        if live.num_tokens != hit:
            if self.runner.layout.requires_checkpoint:
                return None
            self.runner.crop(state, hit)
        return state

    # -- endings ----------------------------------------------------------------------------

    def _token(self, req: Request, events: list[Event]) -> Moved:
        reason = emit_token(req, self.runner.eos_ids, events)
        return Moved(Phase.DECODE, events) if reason is None else self._finish(req, reason, events)

    def _finish(self, req: Request, reason: str, events: list[Event]) -> Moved:
        finish_reply(req, reason, events)
        n, gen = req.num_prompt, req.generated
        save = (
            req.seq is not None
            and bool(gen)
            and reason not in ("cancelled", "timeout")
            and n + len(gen) < self.max_context
        )
        return Moved(Phase.SAVE if save else Phase.DONE, events)


def _attempt(action: Callable[..., Moved], req: Request, *args: Any) -> Moved:
    """One request's part after a shared forward; its exception is its outcome."""
    try:
        return action(req, *args)
    except Exception as exc:
        return Moved(exc)
