"""Built-in eviction policies, one module each; importing this package registers them."""

from promptcache.core.policies import lru  # noqa: F401
