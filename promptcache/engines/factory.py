"""Choosing and building the engine for ``promptcache serve`` and ``bench``."""

from __future__ import annotations

import importlib.util
import platform
from typing import Any


def pick_engine(name: str) -> str:
    """auto: mlx on Apple Silicon when mlx-lm is installed, else torch."""
    if name != "auto":
        return name
    if (
        platform.system() == "Darwin"
        and platform.machine() == "arm64"
        and importlib.util.find_spec("mlx_lm")
    ):
        return "mlx"
    return "torch"


def build_engine(
    engine: str = "auto",
    model: str | None = None,
    *,
    cache_enabled: bool = True,
    block_size: int = 64,
    ram_budget: str | int | None = None,
    prefill_chunk: int = 512,
    max_context: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    policy: str | None = None,
    ssd_dir: str | None = None,
    ssd_budget: str | int = "10GB",
    ssd_retention: float | None = None,
) -> Any:
    from promptcache.models import resolve_model

    kind = pick_engine(engine)
    path = resolve_model(model)
    if kind == "torch":
        from promptcache.engines.torch_engine import TorchEngine

        return TorchEngine.load(
            path,
            dtype=dtype,
            device=device,
            cache_enabled=cache_enabled,
            block_size=block_size,
            ram_budget=ram_budget,
            prefill_chunk=prefill_chunk,
            max_context=max_context,
            policy=policy,
            ssd_dir=ssd_dir,
            ssd_budget=ssd_budget,
            ssd_retention=ssd_retention,
        )
    if kind == "mlx":
        raise SystemExit("the mlx engine is not available in this version yet; use --engine torch")
    raise SystemExit(f"unknown engine {engine!r}: use auto, torch or mlx")
