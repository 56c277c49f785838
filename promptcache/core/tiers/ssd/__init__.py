"""The SSD tier: safetensors block files indexed in SQLite. Others import ``tier`` (``SsdTier``)
and, working on a folder without a running tier (``promptcache cache``), ``index``, ``lock``,
``reconcile`` and ``sessions.remove_rows``; ``folder``, ``read``, ``write``, ``capacity`` and
``stats`` are the tier's own parts."""

__all__ = ["entry", "index", "lock", "reconcile", "sessions", "tier"]
