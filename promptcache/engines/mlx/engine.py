"""MLX/mlx-lm engine: ``CachedEngine`` on an ``MlxRunner`` (optionally a quantized KV cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from promptcache.engines.mlx.runner import MlxRunner, load_mlx_weights
from promptcache.serving.block_scheme import pop_block_scheme
from promptcache.serving.cached_engine import CachedEngine


class MlxEngine(CachedEngine):
    name = "mlx"

    def __init__(self, model: Any, tokenizer: Any, **options: Any) -> None:
        """``options``: the runner's (``kv_bits``, ``kv_group_size``: a quantized KV cache),
        the cache and serving options (``EngineOptions``) and the block scheme's
        (``cache_kv_bits``, ...: see TorchEngine)."""
        scheme = pop_block_scheme(options)
        kv = {k: options.pop(k) for k in ("kv_bits", "kv_group_size") if k in options}
        super().__init__(MlxRunner(model, tokenizer, block_scheme=scheme, **kv), **options)

    load_weights = staticmethod(load_mlx_weights)

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **options: Any
    ) -> MlxEngine:
        """An engine on the model folder ``path`` via ``mlx_lm.load``; ``options`` as for the
        constructor. A ``max_context`` above the native context loads the model with YaRN RoPE
        scaling, or raises ``ContextExtensionError``. The model id defaults to the folder name."""
        path = Path(path)
        model, tokenizer = load_mlx_weights(
            path, dtype=dtype, device=device, max_context=options.get("max_context")
        )
        return cls(model, tokenizer, model_id=options.pop("model_id", path.name), **options)
