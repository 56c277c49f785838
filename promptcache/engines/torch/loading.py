"""Loading a transformers checkpoint for the torch engine: weights (with its conversions), the
model class, the processor of a vision model, and a check that its forward runs."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from promptcache.engines.torch.vision_select import image_families
from promptcache.engines.torch.weights import check_weights_mode, quantize_linears
from promptcache.errors import ConfigError
from promptcache.models import context_extension_note, rope_scaling_for

log = logging.getLogger("promptcache")


def load_torch_weights(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_context: int | None = None,
    weights: str | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) from an HF folder, for sharing one model between engines. A
    ``max_context`` above the native context loads the model with YaRN RoPE scaling (or raises
    ContextExtensionError when it has no plain RoPE to scale). ``weights``: ``int8``/``int4``
    replace the linear layers by quantized ones (``torch.weights``); None keeps the dtype."""
    weights = check_weights_mode(weights, device)
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:  # e.g. a model type this transformers lacks
        raise load_error(path, exc) from None
    rope = rope_scaling_for(config.to_dict(), max_context)  # refuses before any loading
    tokenizer = AutoTokenizer.from_pretrained(path)
    if rope is not None:  # before the weights load: the rotary tables are built from config
        config.rope_parameters = rope
        config.max_position_embeddings = max_context
    try:
        model = model_class(config).from_pretrained(
            path, config=config, dtype=getattr(torch, dtype)
        )
    except (ValueError, KeyError, OSError, RuntimeError) as exc:  # transformers refusing it
        raise load_error(path, exc) from None
    model = model.to(device).eval()
    quantize_linears(model, weights)
    check_forward(model, path)  # after the swap: the quantized kernels run too
    # read back by TorchRunner (an engine built on a shared model reports it too)
    object.__setattr__(model, "promptcache_rope_scaling", rope)
    if rope is not None:
        log.info("%s: %s", Path(path).name, context_extension_note(rope))
    return model, tokenizer


def model_class(config: Any) -> Any:
    """A vision-language checkpoint's image-text class when transformers has one for it (the
    decoder's weights under ``model.language_model``), else the causal-LM class."""
    from transformers import AutoModelForImageTextToText

    if is_vision_config(config) and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_error(path: str | Path, exc: Exception) -> ConfigError:
    """transformers refusing a checkpoint, as a start-up error that says what to do instead."""
    from transformers import __version__

    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    return ConfigError(
        f"transformers {__version__} cannot load {path}: {reason}. Use --engine mlx if mlx-lm "
        "has this architecture, or a transformers version that has it."
    )


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


@torch.inference_mode()
def check_forward(model: Any, path: str | Path) -> None:
    """One token through a fresh cache, so a model that cannot serve is refused at start-up
    (ConfigError, the reason) instead of failing every request."""
    try:
        ids = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
        arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        model(input_ids=ids, use_cache=True, **{arg: DynamicCache(config=model.config)})
    except Exception as exc:  # whatever the library raises: it is the reason given
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{path} cannot serve on torch ({type(exc).__name__}: {reason}); try --engine mlx, "
            "or another --dtype"
        ) from None


def load_torch_processor(path: str | Path) -> Any:
    """What a vision-language folder's images need, or None: its ``AutoProcessor``, or its image
    processor alone where the processor cannot load (Qwen's video processor needs torchvision;
    images do not). None for a text-only model, or a family whose images are not supported
    (said in the log: text chat is served, image parts get a 400)."""
    config = AutoConfig.from_pretrained(path)
    if not is_vision_config(config):
        return None
    families = image_families()
    name = Path(path).name
    if config.model_type not in families:
        log.warning(
            "%s: images are not supported for %s on the torch engine (supported: %s); serving "
            "text only (image parts get a 400)",
            name, config.model_type, ", ".join(sorted(families)),
        )  # fmt: skip
        return None
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as exc:  # e.g. a video processor that needs torchvision: images do not
        log.info("%s: using the image processor alone (%s)", name, _first_line(exc))
        try:
            processor = AutoImageProcessor.from_pretrained(path)
        except Exception as exc2:  # no preprocessor_config.json: a decoder-only export
            log.warning(
                "%s: images are not supported for this checkpoint on the torch engine (its image "
                "processor cannot load: %s); serving text only (image parts get a 400)",
                name, _first_line(exc2),
            )  # fmt: skip
            return None
    if not can_serve_images(config, processor):
        log.warning(
            "%s: images for %s need its processor, which cannot load (install torchvision); "
            "serving text only (image parts get a 400)", name, config.model_type,
        )  # fmt: skip
        return None
    log.info("%s: images on (%s: %s)", name, config.model_type, families[config.model_type])
    return processor


def can_serve_images(config: Any, processor: Any) -> bool:
    """Whether ``processor`` serves ``config``'s images (an image processor alone cannot, for a
    family laid out by its full processor)."""
    from promptcache.engines.torch.vision_expand import EXPANDED, OWN_LAYOUT, layout_kind

    kind = layout_kind(config)
    alone = getattr(processor, "tokenizer", None) is None
    return not (alone and kind in EXPANDED and kind not in OWN_LAYOUT)


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
