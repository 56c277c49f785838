"""MLX/mlx-lm model runner: load, fingerprint, and the model steps on mlx-lm's cache list
(optionally a quantized KV cache); ``mlx_state`` converts it to and from core payloads.

Runs wherever MLX does: Apple Silicon (unified memory, Metal) and Linux CPU. Block payloads stay
MLX arrays in the RAM tier; sizes come from shapes, never from evaluating an array.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from promptcache.core.hashing import fingerprint_model
from promptcache.engines.mlx.batch import batched_decode, can_batch
from promptcache.engines.mlx.config import load_error, mlx_model_config, text_args
from promptcache.engines.mlx.quant import MlxPacker
from promptcache.engines.mlx.state import (
    MlxCacheSteps,
    describe_cache,
    evaluate_module,
)
from promptcache.errors import ConfigError
from promptcache.serving.block_scheme import BlockScheme
from promptcache.serving.fingerprint import VOLATILE_CONFIG_KEYS, digest_weights
from promptcache.serving.layers import Layout

KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
log = logging.getLogger("promptcache")


def _mlx_rope_scaling(config: dict[str, Any], max_context: int | None) -> dict[str, Any] | None:
    """``rope_scaling_for`` checked against the mlx-lm model args the config loads into: they
    must take ``rope_scaling``, and their rope_theta default stands in for a config without one."""
    from mlx_lm.utils import _get_classes

    from promptcache.models import ContextExtensionError, native_context, rope_scaling_for

    native = native_context(config)
    if not max_context or max_context <= native:
        return None
    fields = {f.name: f for f in dataclasses.fields(_get_classes(config)[1])}
    if "rope_scaling" not in fields:
        reason = f"mlx-lm's {config.get('model_type')} model takes no RoPE scaling"
        raise ContextExtensionError(native, max_context, reason)
    theta = fields.get("rope_theta")
    if "rope_theta" not in config and "rope_parameters" not in config and theta is not None:
        config = {**config, "rope_theta": theta.default}
    return rope_scaling_for(config, max_context)


def load_mlx_weights(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_context: int | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) via ``mlx_lm.load``; ``dtype`` casts floating weights, except in a
    quantized model (its scales and biases keep the dtype they were quantized with). A
    ``max_context`` above the native context loads the model with YaRN RoPE scaling (or raises
    ContextExtensionError when it cannot be extended). ``device`` is MLX's default device."""
    import mlx.nn as nn
    from mlx_lm import load

    from promptcache.models import context_extension_note

    config = json.loads((Path(path) / "config.json").read_text())
    model_config = mlx_model_config(config)
    rope = _mlx_rope_scaling({**config, **model_config}, max_context)
    if rope is not None:
        # "type" too: some mlx-lm model args insist on it; initialize_rope reads either
        model_config["rope_scaling"] = {**rope, "type": "yarn"}
        model_config["max_position_embeddings"] = max_context
    try:
        model, tokenizer = load(str(path), model_config=model_config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # mlx-lm refusing the config
        raise load_error(path, exc) from None
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    if not any(isinstance(m, quantized) for _, m in model.named_modules()):
        model.set_dtype(getattr(mx, dtype))
    check_forward(model, path)
    if rope is not None:
        args = text_args(model)
        if args is not None:  # some model args have no such field: the runner reads it here
            args.max_position_embeddings = max_context
        log.info("%s: %s", Path(path).name, context_extension_note(rope))
    # object.__setattr__: an mlx Module stores a dict attribute as a child module's params
    object.__setattr__(model, "promptcache_rope_scaling", rope)
    return model, tokenizer


def _one_token(model: Any) -> Any:
    cache = make_prompt_cache(model)
    return model(mx.array([[0]]), cache=cache), [c.state for c in cache]


def check_forward(model: Any, path: str | Path, step: Callable[[Any], Any] = _one_token) -> None:
    """One token through a fresh cache (``step(model)``: the arrays it computes; default
    mlx-lm's), so a model that cannot serve is refused at start-up (ConfigError) instead of
    failing every request. Kernels some backends have only for float32 (mlx's CPU ``GatherMM``:
    MoE layers in bfloat16/float16) get the model cast to float32, said in the log."""
    for attempt in range(2):
        try:
            mx.eval(step(model))
            return
        except Exception as exc:  # whatever the library raises: it is the reason given
            dtype = next(v for _, v in tree_flatten(model.parameters())).dtype
            if attempt == 0 and dtype != mx.float32 and "float32" in str(exc):
                log.warning(
                    "%s: %s on mlx's %s device; casting the model to float32 (%s)",
                    Path(path).name, dtype, mx.default_device(), str(exc).splitlines()[0][:200],
                )  # fmt: skip
                model.set_dtype(mx.float32)
                continue
            reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"{path} cannot serve on mlx ({type(exc).__name__}: {reason}); try --engine "
                "torch, or another --dtype"
            ) from None


def _config_of(model: Any) -> dict[str, Any]:
    args = getattr(model, "args", None)
    raw = vars(args) if args is not None else {}
    return {k: v for k, v in raw.items() if k not in VOLATILE_CONFIG_KEYS}


class MlxRunner(MlxCacheSteps):
    """An mlx-lm model (see ``ModelRunner`` for the contract). ``kv_bits``: a quantized KV
    cache (part of the fingerprint: its blocks differ from full-precision ones).
    ``block_scheme``: how positional blocks are stored at rest (part of the fingerprint too)."""

    name = "mlx"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        block_scheme: BlockScheme | None = None,
    ) -> None:
        if kv_bits is not None and kv_bits not in KV_BITS:
            raise ConfigError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}")
        if kv_group_size not in KV_GROUP_SIZES:
            raise ConfigError("kv_group_size must be 32, 64 or 128")
        args = text_args(model)  # flat, or nested in a vision-language model's text_config
        heads = getattr(args, "num_attention_heads", None)
        head_dim = getattr(args, "head_dim", None) or (
            args.hidden_size // heads if heads and getattr(args, "hidden_size", None) else None
        )
        if kv_bits is not None and head_dim and head_dim % kv_group_size:
            raise ConfigError(f"kv_group_size {kv_group_size} must divide the head size {head_dim}")
        self.model = model
        evaluate_module(model)  # before any step runs on the stepping thread
        self.tokenizer = tokenizer
        # the YaRN settings load_mlx_weights applied to reach max_context, or None
        self.rope_scaling: dict[str, Any] | None = getattr(model, "promptcache_rope_scaling", None)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.layout: Layout = describe_cache(self.new_state())
        self.block_scheme = block_scheme or BlockScheme()
        self.block_scheme.check()
        if kv_bits is not None and not self.block_scheme.is_default:
            # its blocks are already quantized: their scales must not be quantized again
            raise ConfigError("--cache-kv-bits/--cache-dtype need a full-precision live cache")
        model_dtype = next(v for _, v in tree_flatten(model.parameters())).dtype
        dtype = str(model_dtype)
        self.packer = (
            None if self.block_scheme.is_default else MlxPacker(self.block_scheme, model_dtype)
        )
        quant = f"kv{kv_bits}g{kv_group_size}" if kv_bits else "kv-full"
        self.fingerprint = fingerprint_model(
            _config_of(model),
            digest_weights(
                tree_flatten(model.parameters()), lambda a: np.asarray(a.astype(mx.float32))
            ),
            f"{dtype}:{quant}{self.block_scheme.tag}",
            self.name,
        )
        eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self.vocab_size = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self.model_limit = int(getattr(args, "max_position_embeddings", None) or 2048)

    def new_state(self, num_positions: int = 0) -> list[Any]:
        cache = make_prompt_cache(self.model)  # mlx-lm grows its caches by steps: no hint
        if self.kv_bits is None:
            return cache
        return [
            QuantizedKVCache(self.kv_group_size, self.kv_bits) if type(c) is KVCache else c
            for c in cache
        ]

    def forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[mx.array]:
        # several one-token steps (decode): one forward through mlx-lm's batch caches; prefill
        # chunks of different lengths (and a quantized KV cache) one sequence at a time
        if all(len(x) == 1 for x in ids) and self.batches_decode(states):
            return batched_decode(self.model, states, [x[0] for x in ids])
        return [
            self._forward_one(state, seq_ids) for state, seq_ids in zip(states, ids, strict=True)
        ]

    def batches_decode(self, states: Sequence[Any]) -> bool:
        return len(states) > 1 and can_batch(states[0])

    def _forward_one(self, state: list[Any], ids: Sequence[int]) -> mx.array:
        ids = list(ids)
        # the lm head runs on the last position only: earlier positions' logits are never used
        if len(ids) > 1:
            self.model(mx.array([ids[:-1]]), cache=state)
            mx.eval([c.state for c in state])
        logits = self.model(mx.array([ids[-1:]]), cache=state)[0, -1]
        mx.eval(logits, [c.state for c in state])
        return logits
