"""PyTorch/transformers engine: chunked prefill that reuses and feeds the prompt cache, then decode."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from promptcache.core.budget import parse_size
from promptcache.core.cache import Lease, PromptCache
from promptcache.core.hashing import digest_bytes, fingerprint_model
from promptcache.core.sequence import TokenSeq
from promptcache.core.ssd_tier import SsdTier
from promptcache.engines.base import (
    EngineError,
    Event,
    Finished,
    PrefillDone,
    PromptTooLongError,
    SamplingParams,
    TextDelta,
)
from promptcache.engines.textstream import StopTextStream
from promptcache.engines.torch_codec import TorchCodec
from promptcache.engines.torch_state import (
    LayerLayout,
    crop_positional,
    describe_layers,
    restore_cache,
    slice_positional,
    take_checkpoint,
)

_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "architectures",
    "_commit_hash",
}


def weights_digest(model: torch.nn.Module) -> str:
    """Digest of every parameter's name, shape, dtype and a strided sample of its values."""
    parts = []
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu().numpy().tobytes()
        parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode() + digest_bytes(sample))
    return digest_bytes(b"|".join(parts)).hex()


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = (
            cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        )  # keep the first that crosses
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class TorchEngine:
    name = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
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
        if prefill_chunk <= 0:
            raise ValueError("prefill_chunk must be positive")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.prefill_chunk = prefill_chunk
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_context = min(max_context or limit, limit)
        self.layout: LayerLayout = describe_layers(DynamicCache(config=model.config))
        config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        self.fingerprint = fingerprint_model(
            config, weights_digest(model), str(self.dtype), self.name
        )
        if cache is None and cache_enabled and next_tier is None and ssd_dir is not None:
            next_tier = SsdTier(
                ssd_dir,
                self.fingerprint,
                codec=TorchCodec(self.device),
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
        self._lock = threading.Lock()
        # the last request's live KV and the sequence it covers: a hit that it also covers is
        # served from it directly (bitwise the same state as restoring the blocks, minus the copy)
        self._live: tuple[DynamicCache, TokenSeq] | None = None
        forward_args = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in forward_args
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        eos = (
            getattr(model.generation_config, "eos_token_id", None)
            if hasattr(model, "generation_config")
            else None
        )
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **kwargs: Any
    ) -> TorchEngine:
        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        return cls(model, tokenizer, model_id=kwargs.pop("model_id", path.name), **kwargs)

    # -- prompts -----------------------------------------------------------------------------

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
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, kv: DynamicCache, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs = {"logits_to_keep": 1} if self._keep_arg else {}
        kwargs[self._cache_arg] = kv
        out = self.model(input_ids=x, use_cache=True, **kwargs)
        return out.logits[0, -1]

    def _save(self, seq: TokenSeq, kv: DynamicCache, num_tokens: int) -> None:
        assert self.cache is not None
        layout = self.layout
        self.cache.save(
            seq,
            num_tokens,
            (lambda s, e: slice_positional(kv, layout, s, e)) if layout.positional else None,
            take_checkpoint(kv, layout),
        )

    def _reuse_live(self, seq: TokenSeq, hit: int) -> DynamicCache | None:
        if self._live is None:
            return None
        kv, live = self._live
        if (
            live.root != seq.root
            or live.num_tokens < hit
            or live.block_bytes(0, hit) != seq.block_bytes(0, hit)
        ):
            return None
        if live.num_tokens != hit:
            if self.layout.snapshot:  # recurrent state cannot be rewound
                return None
            crop_positional(kv, self.layout, hit)
        return kv

    def prefill(
        self, prompt_ids: list[int], tenant: str = ""
    ) -> tuple[DynamicCache, torch.Tensor, Lease | None, TokenSeq | None]:
        """Restore the longest cached prefix, prefill the rest in chunks (saving at each chunk
        boundary and at the end). Returns the live cache, last-token logits, the pinned lease
        (release it when the request ends) and the sequence."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineError("the prompt is empty")
        if n >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this server's context is {self.max_context} tokens"
            )
        lease: Lease | None = None
        seq: TokenSeq | None = None
        start = 0
        kv = DynamicCache(config=self.model.config)
        if self.cache is not None:
            seq = self.cache.sequence(prompt_ids, tenant=tenant)
            lease = self.cache.lookup(seq)
            if lease.num_tokens:
                kv = self._reuse_live(seq, lease.num_tokens) or restore_cache(
                    self.model.config, self.layout, lease.segments(), lease.checkpoint, self.device
                )
                start = lease.num_tokens
        self._live = None  # the live KV is now this request's (or stale)
        try:
            pos = start
            logits = None
            while pos < n:
                end = min(n, (pos // self.prefill_chunk + 1) * self.prefill_chunk)
                logits = self._forward(kv, prompt_ids[pos:end])
                pos = end
                if seq is not None:
                    self._save(seq, kv, pos)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        assert logits is not None
        return kv, logits, lease, seq

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        params.validate()
        t0 = time.perf_counter()
        with self._lock:
            if cancel is not None and cancel.is_set():  # the client left while queued
                yield Finished("cancelled", len(prompt_ids), 0, 0, "")
                return
            kv, logits, lease, seq = self.prefill(prompt_ids, tenant)
            try:
                n = len(prompt_ids)
                cached = lease.num_tokens if lease is not None else 0
                yield PrefillDone(
                    n, cached, time.perf_counter() - t0, lease.kind if lease is not None else "off"
                )
                generator = None
                if params.seed is not None:
                    generator = torch.Generator(device="cpu").manual_seed(params.seed)
                max_new = min(params.max_tokens, self.max_context - n)
                stream = StopTextStream(self.decode, params.stop)
                generated: list[int] = []
                reason = "length"
                next_id = sample_token(logits.cpu(), params, generator)
                for step in range(max_new):
                    if cancel is not None and cancel.is_set():
                        reason = "cancelled"
                        break
                    generated.append(next_id)
                    if next_id in self.eos_ids:
                        reason = "stop"
                        break
                    delta = stream.push(next_id)
                    if delta:
                        yield TextDelta(delta, [next_id])
                    if stream.stopped:
                        reason = "stop"
                        break
                    if step == max_new - 1:
                        break
                    next_id = sample_token(self._forward(kv, [next_id]).cpu(), params, generator)
                tail = stream.flush()
                if tail:
                    yield TextDelta(tail, [])
                yield Finished(
                    reason,
                    n,
                    len(generated),
                    cached,
                    stream.text,
                    stream.matched_stop,
                    list(generated),
                )
                # after the reply: feed the last sampled token so the saved state covers prompt +
                # every generated token, and the next turn hits the assistant's reply too
                if (
                    seq is not None
                    and generated
                    and reason != "cancelled"
                    and n + len(generated) < self.max_context
                ):
                    self._forward(kv, [generated[-1]])
                    full = seq.extend(generated)
                    self._save(full, kv, n + len(generated))
                    self._live = (kv, full)
            finally:
                if lease is not None:
                    lease.release()

    def cache_stats(self) -> dict[str, Any]:
        return self.cache.stats().to_dict() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
