"""The engine-agnostic core: block hashes, the prefix tree, the tiers, policies; no torch, no mlx.

What engines and the server import: ``cache`` (``PromptCache``), ``admin`` (``CacheAdmin``),
``sequence``, ``hashing``, ``lease``, ``stats``, ``sessions``, ``images``, ``codec``, ``budget``,
``cipher``, ``evictions``, ``policy``, ``vision_cache``, and the ``tiers`` package. The rest
(``tree``, ``chain``, ``block``, ``block_file``, ``minisim``, ``whatif``...) serves those.
"""

__all__ = [
    "admin",
    "budget",
    "cache",
    "cipher",
    "codec",
    "evictions",
    "hashing",
    "images",
    "lease",
    "policy",
    "sequence",
    "sessions",
    "stats",
    "tiers",
    "vision_cache",
]
