"""MLX vision-language engine: ``CachedEngine`` on an ``MlxVlmRunner`` (an mlx-vlm model with its
processor; images through ``serving.vision``, the vision-embedding cache included), a
``MropeRunner`` for the Qwen-VL family's 3-D positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from promptcache.engines.mlx.vlm_gemma3 import Gemma3Runner
from promptcache.engines.mlx.vlm_load import MROPE_TYPES, load_mlx_vlm
from promptcache.engines.mlx.vlm_mrope import MropeRunner
from promptcache.engines.mlx.vlm_runner import MlxVlmRunner
from promptcache.serving.block_scheme import pop_block_scheme
from promptcache.serving.cached_engine import CachedEngine


class MlxVlmEngine(CachedEngine):
    name = "mlx"
    takes_images = True  # the factory's check: no --kv-bits (a quantized live cache) here

    def __init__(self, model: Any, processor: Any, **options: Any) -> None:
        """``processor``: the model's mlx-vlm processor; ``options``: the cache and serving
        options (``EngineOptions``) and the block scheme's (see TorchEngine)."""
        scheme = pop_block_scheme(options)
        kind = model.config.model_type
        cls = MropeRunner if kind in MROPE_TYPES else Gemma3Runner if kind == "gemma3" else None
        runner = (cls or MlxVlmRunner)(model, processor, scheme)
        super().__init__(runner, **options)

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **options: Any
    ) -> MlxVlmEngine:
        """An engine on the mlx-vlm model folder ``path`` (``device``: MLX's default device; no
        context extension: ``max_context`` is capped at the model's). The model id defaults to
        the folder name."""
        path = Path(path)
        model, processor = load_mlx_vlm(path, dtype=dtype)
        return cls(model, processor, model_id=options.pop("model_id", path.name), **options)
