"""Importing and loading mlx-vlm models without changing transformers for the rest of the process.

Importing an mlx-vlm model package (``mlx_vlm.models.llava``, ...) replaces transformers'
``AutoProcessor.from_pretrained`` process-wide so that a folder of that model type loads
mlx-vlm's processor (which returns MLX arrays). A transformers engine in the same process (the
server never mixes them, but tests and benchmarks do) would then get that processor for its own
LLaVA folder. So the packages are imported under ``transformers_as_is``, which puts the original
back, and processors are loaded through the model package's processor class by name.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from promptcache.errors import ConfigError

_QWEN3_PROCESSOR = "mlx_vlm.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor"
# model_type -> (package, processor class): llava's image tokens are plain causal positions with
# 1-D RoPE; the Qwen-VL family's take 3-D M-RoPE positions (``vlm_mrope``); Gemma 3's attend
# to each other (``vlm_gemma3``)
SUPPORTED = {
    "llava": ("mlx_vlm.models.llava", "mlx_vlm.models.llava.processing_llava.LlavaProcessor"),
    "qwen2_vl": (
        "mlx_vlm.models.qwen2_vl",
        "mlx_vlm.models.qwen2_vl.processing_qwen2_vl.Qwen2VLProcessor",
    ),
    "qwen2_5_vl": (
        "mlx_vlm.models.qwen2_5_vl",
        "mlx_vlm.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor",
    ),
    "qwen3_vl": ("mlx_vlm.models.qwen3_vl", _QWEN3_PROCESSOR),
    "qwen3_vl_moe": ("mlx_vlm.models.qwen3_vl_moe", _QWEN3_PROCESSOR),
    "qwen3_5": ("mlx_vlm.models.qwen3_5", _QWEN3_PROCESSOR),
    "qwen3_5_moe": ("mlx_vlm.models.qwen3_5_moe", _QWEN3_PROCESSOR),
    "glm4v": ("mlx_vlm.models.glm4v", "mlx_vlm.models.glm4v.processing.Glm46VProcessor"),
    "glm4v_moe": (
        "mlx_vlm.models.glm4v_moe",
        "mlx_vlm.models.glm4v_moe.processing.Glm46VMoEProcessor",
    ),
    "gemma3": (
        "mlx_vlm.models.gemma3",
        "mlx_vlm.models.gemma3.processing_gemma3.Gemma3Processor",
    ),
}
MROPE_TYPES = frozenset(SUPPORTED) - {"llava", "gemma3"}  # image positions from the image's grid


@contextmanager
def transformers_as_is() -> Iterator[None]:
    """Whatever mlx-vlm imports inside, ``transformers.AutoProcessor.from_pretrained`` is the
    same afterwards."""
    from transformers import AutoProcessor

    original = AutoProcessor.__dict__["from_pretrained"]
    try:
        yield
    finally:
        if AutoProcessor.__dict__["from_pretrained"] is not original:
            setattr(AutoProcessor, "from_pretrained", original)  # noqa: B010


def model_package(model_type: str) -> ModuleType:
    """The mlx-vlm package of a supported model type (ConfigError for the others)."""
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"image input on the mlx engine supports {', '.join(SUPPORTED)} models, "
            f"not {model_type!r}"
        )
    with transformers_as_is():
        return importlib.import_module(SUPPORTED[model_type][0])


def processor_class(model_type: str) -> Any:
    model_package(model_type)
    module_name, cls_name = SUPPORTED[model_type][1].rsplit(".", 1)
    with transformers_as_is():
        module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def is_vlm_folder(path: str | Path) -> bool:
    """True when ``path`` holds a vision-language model's config (a ``vision_config``)."""
    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def has_image_path(path: str | Path) -> bool:
    """True when the folder's architecture is one the mlx-vlm image path supports."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") in SUPPORTED
    except (OSError, ValueError):
        return False


def load_mlx_vlm(path: str | Path, *, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, processor) from a local mlx-vlm folder (weights in MLX layout): the model via
    ``mlx_vlm.utils.load_model``, the processor via its class's ``from_pretrained``; ``dtype``
    casts the floating weights (a quantized model keeps its own)."""
    import mlx.core as mx
    import mlx.nn as nn

    from promptcache.engines.mlx.runner import check_forward

    path = Path(path)
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    cls = processor_class(model_type)
    with transformers_as_is():
        from mlx_vlm.utils import load_model

        try:
            model = load_model(path)
        # e.g. weight names of another layout, a config mlx-vlm's classes do not read (a
        # transformers 5 config: rope_parameters, the text sizes nested where it wants them flat)
        except (ValueError, FileNotFoundError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(
                f"{path} does not load as an mlx-vlm {model_type} model (weights in mlx-vlm's "
                f"layout, e.g. from mlx_vlm.convert): {str(exc)[:300]}"
            ) from None
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    if not any(isinstance(m, quantized) for _, m in model.named_modules()):
        model.set_dtype(getattr(mx, dtype))
    check_forward(model, path, _one_token)  # refused, or cast to float32, at start-up
    return model, cls.from_pretrained(str(path))


def _one_token(model: Any) -> Any:
    """One token through the language model on a fresh mlx-vlm cache: the arrays it computes."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    out = model.language_model(mx.array([[0]]), cache=cache)
    return out.logits, [c.state for c in cache]
