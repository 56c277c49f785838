"""Built-in eviction policies, one module each; importing this package registers them, so
``make_policy`` and ``policy_names`` from here always know every built-in."""

from promptcache.core.policies import adaptive, frecency, lru, recompute, s3fifo, session, taper  # noqa: F401
from promptcache.core.policy import DEFAULT_POLICY, make_policy, policy_names

__all__ = [
    "DEFAULT_POLICY", "adaptive", "frecency", "lru", "make_policy", "policy_names", "recompute",
    "s3fifo", "session", "taper",
]  # fmt: skip
