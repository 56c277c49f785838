"""What mlx-lm needs to read a checkpoint's config, and the text model's sizes once loaded.

Checkpoints come in two nestings: flat (the decoder's sizes at the top) and a vision-language
checkpoint's ``text_config`` (+ ``vision_config``), which mlx-lm keeps nested in its model args
(qwen3_5, gemma3, mistral3...). ``text_args`` reads the decoder's sizes from either. Configs
written by transformers 5 keep RoPE settings in ``rope_parameters`` and name a multimodal
family's text-only model ``<family>_text``; ``mlx_model_config`` adds what mlx-lm's readers
look for instead, derived from the config itself (never from a table of model types).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace
from typing import Any

from promptcache.errors import ConfigError


def _has_module(model_type: str) -> bool:
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def _mlx_model_type(model_type: str) -> str:
    """mlx-lm's module for ``model_type``: itself, else (for transformers' ``<family>_text``
    text-only configs) the family's module, whose model args take a flat config too."""
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    if not _has_module(name) and name.endswith("_text") and _has_module(name[: -len("_text")]):
        return name[: -len("_text")]
    return model_type


def _rope_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The older RoPE keys mlx-lm's model args read, from transformers 5's ``rope_parameters``."""
    from promptcache.models import legacy_rope_keys

    out = legacy_rope_keys(config)
    rope = config.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    if "partial_rotary_factor" in rope and "partial_rotary_factor" not in config:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    per_type = [v for v in rope.values() if isinstance(v, dict)]
    if per_type and len(per_type) == len(rope) and "rope_theta" not in config:
        # RoPE per layer type (transformers 5 with layer_types): the full-attention layers'
        # base is the model's rope_theta, the sliding ones' its local base where it has one
        full = rope.get("full_attention", per_type[0])
        if "rope_theta" in full:
            out["rope_theta"] = full["rope_theta"]
        local = rope.get("sliding_attention") or {}
        if "rope_theta" in local and "rope_local_base_freq" not in config:
            out["rope_local_base_freq"] = local["rope_theta"]
    return out


def _aliases(model_type: str) -> dict[str, str]:
    """transformers' own renames for this model type's config (``attribute_map``: the name a
    checkpoint of an older transformers wrote -> the name transformers 5 writes)."""
    try:
        from transformers import AutoConfig

        return dict(AutoConfig.for_model(model_type).attribute_map)
    except Exception:  # a type transformers lacks, or a config without defaults: no renames
        return {}


def _required_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Required model-args fields a transformers 5 config leaves out but implies: a field
    transformers renamed (its ``attribute_map``), no ``rope_scaling`` when its RoPE is plain."""
    from mlx_lm.utils import _get_classes

    try:
        args_class = _get_classes(config)[1]
    except ValueError:
        return {}  # an unknown model type: load reports it
    if not dataclasses.is_dataclass(args_class):
        return {}
    out: dict[str, Any] = {}
    aliases = _aliases(str(config.get("model_type", "")))
    for f in dataclasses.fields(args_class):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if not required or f.name in config:
            continue
        if aliases.get(f.name) in config:
            out[f.name] = config[aliases[f.name]]
            continue
        rope = config.get("rope_parameters") or {}
        if f.name == "rope_scaling" and rope.get("rope_type", "default") == "default":
            out["rope_scaling"] = None
    return out


def _tagged_floats(value: Any) -> Any:
    """``value`` with transformers 5's JSON tags for non-finite floats (``{"__float__":
    "Infinity"}``) turned back into floats, which is what mlx-lm's readers expect."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _tagged_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tagged_floats(v) for v in value]
    return value


def mlx_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """Overrides for ``mlx_lm.load(model_config=)`` that let mlx-lm read ``config`` as its
    architecture means it (empty when it reads it as is)."""
    out = {k: _tagged_floats(v) for k, v in config.items() if "'__float__'" in repr(v)}
    config = {**config, **out}
    out.update(_rope_keys(config))
    if "position_embedding_type" in config and config["position_embedding_type"] is None:
        out["position_embedding_type"] = "nope"  # transformers 5's None: no RoPE at all
    model_type = str(config.get("model_type", ""))
    mlx_type = _mlx_model_type(model_type)
    if mlx_type != model_type:
        out["model_type"] = mlx_type
    text = config.get("text_config")
    if isinstance(text, dict) and (extra := _rope_keys(text)):
        out["text_config"] = {**text, **extra}
    out.update(_required_defaults({**config, **out}))
    return out


def text_args(model: Any) -> Any:
    """The decoder's model args (``hidden_size``, ``vocab_size``, ``max_position_embeddings``,
    ...) of an mlx-lm model, flat or nested in a ``text_config``; None when it has none."""
    inner = getattr(getattr(model, "language_model", None), "args", None)
    args = getattr(model, "args", None)
    for candidate in (args, inner):
        if candidate is not None and getattr(candidate, "hidden_size", None) is not None:
            return candidate
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        return SimpleNamespace(**text)
    return inner if inner is not None else args


def load_error(path: Any, exc: Exception) -> ConfigError:
    """mlx-lm refusing a checkpoint, as a start-up error that says what to do instead."""
    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    return ConfigError(
        f"mlx-lm {_mlx_lm_version()} cannot load {path}: {reason}. Use --engine torch for this "
        "checkpoint, or an MLX conversion of it (mlx_lm.convert / an mlx-community upload)."
    )


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")
