"""Engine adapters: each turns a model library's cache objects into core blocks and checkpoints.

The server imports ``base`` (the ``Engine`` protocol, events, errors) and ``factory``; an
engine is a ``cached_engine.CachedEngine`` on a library's ``runner.ModelRunner`` (``torch/``,
``mlx/``). ``steps``, ``batching``, ``scheduler`` and ``request`` run its requests."""

__all__ = ["base", "cached_engine", "errors", "factory", "runner", "tiny_models"]
