"""PyTorch/transformers engine: ``CachedEngine`` on a ``TorchRunner``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from promptcache.engines.torch.loading import load_torch_processor, load_torch_weights
from promptcache.engines.torch.runner import TorchRunner
from promptcache.engines.torch.threads import ThreadTuner
from promptcache.serving.block_scheme import pop_block_scheme
from promptcache.serving.cached_engine import CachedEngine


class TorchEngine(CachedEngine):
    name = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        processor: Any = None,
        threads: ThreadTuner | None = None,
        compile: bool = False,
        **options: Any,
    ) -> None:
        """``options``: the cache and serving options (``EngineOptions``) and the block scheme's
        (``cache_kv_bits``, ``cache_kv_group``, ``cache_kv_min_tokens``, ``cache_dtype``).
        ``processor``: a vision-language model's processor (the engine then takes images).
        ``threads``: a ``ThreadTuner`` for torch's intra-op threads (None: left alone).
        ``compile``: compile the decode step now (``torch.compiled``; ``compile_s`` its time)."""
        scheme = pop_block_scheme(options)
        runner = TorchRunner(model, tokenizer, scheme, processor, threads)
        super().__init__(runner, **options)
        self.compile_s = runner.enable_compile() if compile else None

    load_weights = staticmethod(load_torch_weights)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        weights: str | None = None,
        **options: Any,
    ) -> TorchEngine:
        """An engine on the HF model folder ``path``; ``options`` as for the constructor. A
        ``max_context`` above the native context loads the model with YaRN RoPE scaling, or
        raises ``ContextExtensionError``. ``weights``: ``int8``/``int4`` linear layers
        (``torch.weights``). The model id defaults to the folder name."""
        path = Path(path)
        model, tokenizer = load_torch_weights(
            path,
            dtype=dtype,
            device=device,
            max_context=options.get("max_context"),
            weights=weights,
        )
        processor = load_torch_processor(path)
        return cls(
            model, tokenizer, processor, model_id=options.pop("model_id", path.name), **options
        )
