"""Choosing and building the engine for ``promptcache serve`` and ``bench``: engines are
registered by name (``register_engine``: torch, mlx), as tiers and eviction policies are.

Library code: a configuration that cannot work raises ``ConfigError`` (the CLI turns it into
its exit message), never ``SystemExit``."""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from promptcache.errors import ConfigError

log = logging.getLogger("promptcache")


def model_type(path: Any) -> str:
    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type", "?"))
    except (OSError, ValueError):
        return "?"


def pick_engine(name: str, found: Any = None) -> str:
    """auto: mlx for a model saved by mlx-lm (``found``: a ``models.sources.FoundModel``) when
    mlx-lm is installed, and on Apple Silicon when it is; else torch."""
    if name != "auto":
        return name
    has_mlx = importlib.util.find_spec("mlx_lm") is not None
    if has_mlx and found is not None and found.path.is_dir():
        from promptcache.models.sources import is_mlx_folder

        if is_mlx_folder(found.path):
            return "mlx"
    if platform.system() == "Darwin" and platform.machine() == "arm64" and has_mlx:
        return "mlx"
    return "torch"


def check_engine_reads(kind: str, found: Any) -> None:
    """ConfigError when the engine cannot read the model's weights format at all."""
    from promptcache.models.sources import is_mlx_quantized

    if kind == "torch" and found.path.is_dir() and is_mlx_quantized(found.path):
        raise ConfigError(
            f"{found.name} holds mlx-lm quantized weights, which only the mlx engine reads: "
            'use --engine mlx (pip install "promptcache[mlx]"), or a non-MLX build of the model'
        )


def check_weights_engine(kind: str, weights: str | None, device: str) -> str:
    """``--weights`` for the engine ``kind``: int8/int4 on the torch engine only."""
    if kind == "torch":
        from promptcache.engines.torch.weights import check_weights_mode

        return check_weights_mode(weights, device)
    if weights not in (None, "model"):
        raise ConfigError(f"--weights {weights} needs --engine torch (mlx models carry their own)")
    return "model"


def build_engine(
    engine: str = "auto",
    model: str | None = None,
    *,
    revision: str | None = None,
    device: str = "cpu",
    kv_bits: int | None = None,
    cache_kv_bits: int | None = None,
    cache_kv_group: int = 64,
    cache_kv_min_tokens: int = 0,
    cache_dtype: str | None = None,
    threads: int | None = None,
    weights: str | None = None,
    compile: bool = False,
    **options: Any,
) -> Any:
    """The engine for ``model`` (``models.sources.locate_model``; None: the bundled one) on
    ``engine`` (auto | torch | mlx). ``options``: the engine's own (``dtype`` and the
    ``EngineOptions`` fields: cache_enabled, block_size, ram_budget, ssd_dir, shared_url...),
    passed to its ``load``; the rest are checked here against the engine they need."""
    from promptcache.models import prepare_model
    from promptcache.models.sources import locate_model

    if engine != "auto":
        engine_class(engine)  # an unusable engine is refused before any model is resolved
        if kv_bits and engine != "mlx":
            raise ConfigError("--kv-bits needs --engine mlx")
        check_weights_engine(engine, weights, device)
        if compile and engine != "torch":
            raise ConfigError("--compile needs --engine torch (mlx compiles its own graphs)")
    found = locate_model(model, revision)
    kind = pick_engine(engine, found)
    if kv_bits and kind != "mlx":
        raise ConfigError("--kv-bits needs --engine mlx")
    check_engine_reads(kind, found)
    extra: dict[str, Any] = {"kv_bits": kv_bits} if kv_bits else {}
    if kind == "torch":
        from promptcache.engines.torch.threads import hold_one_thread, make_thread_tuner

        extra["weights"] = check_weights_engine(kind, weights, device)
        extra["threads"] = tuner = make_thread_tuner(threads)
        if compile:
            extra["compile"] = True
        if tuner is not None:
            hold_one_thread()  # forwards run on the stepping thread, at the tuner's count
    else:
        check_weights_engine(kind, weights, device)
        if compile:
            raise ConfigError("--compile needs --engine torch (mlx compiles its own graphs)")
    path = prepare_model(found)
    cls = engine_class(kind, path)
    if kv_bits and getattr(cls, "takes_images", False):
        if model_type(path) == "llava":  # no text-only path in mlx-lm
            raise ConfigError("--kv-bits is not supported for vision-language models on mlx-vlm")
        cls = text_only(path, "--kv-bits quantizes the live cache, which mlx-vlm's path does not")
    if cache_kv_bits or cache_dtype:  # how blocks are stored at rest (serving.block_scheme)
        extra.update(
            cache_kv_bits=cache_kv_bits,
            cache_kv_group=cache_kv_group,
            cache_kv_min_tokens=cache_kv_min_tokens,
            cache_dtype=cache_dtype,
        )
    load = dict(device=device, model_id=found.name, **options, **extra)
    try:
        return cls.load(path, **load)
    except ConfigError as exc:
        if not getattr(cls, "takes_images", False) or model_type(path) == "llava":
            raise
        try:  # e.g. an MLX text conversion that kept vision_config but no vision tower
            return text_only(path, str(exc)[:300]).load(path, **load)
        except ConfigError as text_exc:
            raise ConfigError(f"{exc}; as text through mlx-lm: {text_exc}") from None


def text_only(path: Any, reason: str) -> Any:
    """The mlx-lm engine for a vision checkpoint whose image path cannot serve, said in the log."""
    from promptcache.engines.mlx.engine import MlxEngine

    log.warning(
        "%s: images are not supported for %s on the mlx engine here (%s); serving text only "
        "through mlx-lm (image parts get a 400)", Path(path).name, model_type(path), reason,
    )  # fmt: skip
    return MlxEngine


# name -> builder(path): the engine class for the model folder ``path`` (None: before a model is
# resolved). Each builder imports its library itself, so choosing one never imports the other.
_ENGINES: dict[str, Callable[[Any], Any]] = {}


def register_engine(name: str, builder: Callable[[Any], Any]) -> None:
    _ENGINES[name] = builder


def engine_names() -> list[str]:
    return list(_ENGINES)


def engine_class(kind: str, path: Any = None) -> Any:
    """The engine class registered as ``kind`` (for the model folder ``path``: mlx-vlm's engine
    for a vision-language model on mlx); ConfigError with what to do when it can't."""
    builder = _ENGINES.get(kind)
    if builder is None:
        *first, last = ["auto", *_ENGINES]
        raise ConfigError(f"unknown engine {kind!r}: use {', '.join(first)} or {last}")
    return builder(path)


def _torch_engine(path: Any) -> Any:
    from promptcache.engines.torch.engine import TorchEngine

    return TorchEngine


def _mlx_engine(path: Any) -> Any:
    if not importlib.util.find_spec("mlx_lm"):
        raise ConfigError(
            'the mlx engine needs MLX: pip install "promptcache[mlx]" (Linux: mlx[cpu])'
        )
    from promptcache.engines.mlx.vlm_load import SUPPORTED as VLM_SUPPORTED
    from promptcache.engines.mlx.vlm_load import has_image_path, is_vlm_folder

    if path is not None and is_vlm_folder(path) and not has_image_path(path):
        # text chat through mlx-lm, which reads the decoder out of the checkpoint
        log.warning(
            "%s: images are not supported for %s on the mlx engine (supported: %s); serving "
            "text only (image parts get a 400)",
            Path(path).name, model_type(path), ", ".join(VLM_SUPPORTED),
        )  # fmt: skip
    elif path is not None and is_vlm_folder(path):
        if not importlib.util.find_spec("mlx_vlm") and model_type(path) != "llava":
            return text_only(path, 'mlx-vlm is not installed: pip install "promptcache[vlm]"')
        if not importlib.util.find_spec("mlx_vlm"):
            raise ConfigError(
                "a vision-language model on the mlx engine needs mlx-vlm: "
                'pip install "promptcache[vlm]" && pip install --no-deps mlx-vlm==0.7.10'
            )
        from promptcache.engines.mlx.vlm_engine import MlxVlmEngine

        log.info(
            "%s: %s takes images on the mlx engine (mlx-vlm; image families: %s)",
            Path(path).name, model_type(path), ", ".join(VLM_SUPPORTED),
        )  # fmt: skip
        return MlxVlmEngine
    from promptcache.engines.mlx.engine import MlxEngine

    return MlxEngine


register_engine("torch", _torch_engine)
register_engine("mlx", _mlx_engine)
