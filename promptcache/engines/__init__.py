"""Engines: the ``Engine`` protocol the server sees (``base``), the registry that builds one by
name (``factory``), and the adapters, one folder per model library (``torch/``, ``mlx/``): a
``serving.runner.ModelRunner`` and a thin ``serving.cached_engine.CachedEngine`` subclass each.
The serving loop they share lives in ``promptcache.serving``."""
