"""The engine-neutral serving loop: a ``CachedEngine`` drives any library's ``runner.ModelRunner``
through the prompt cache, one ``Steps`` step per request, batched by ``batching.Batcher`` and
moved by ``scheduler.Scheduler``'s stepping thread.

Below ``engines`` (the ``Engine`` protocol, the registry and the torch / mlx adapters, which
implement ``ModelRunner`` and subclass ``CachedEngine``); imports only ``core`` and ``errors``."""
