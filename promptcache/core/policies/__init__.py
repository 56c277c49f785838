"""Built-in eviction policies, one module each; importing this package registers them."""

from promptcache.core.policies import adaptive, frecency, lru, recompute, s3fifo, session  # noqa: F401

__all__ = ["adaptive", "frecency", "lru", "recompute", "s3fifo", "session"]
