"""Tiers: the ``BlockStore`` protocol and its optional capabilities (``base``), the stack that
holds them (``stack``), their shared parts (``write_behind``, ``counters``, ``parts``), the
registry (``registry``, entries typed in ``options``), the factory, and one package per tier
(``ram``, ``ssd``, ``shared``). A new tier is one package implementing ``base.BlockStore``
(usually a ``PartsTier`` of a reader, a writer and a sessions part over ``write_behind``) with
an ``entry`` module (its name, options, flags, build), named once in ``registry.BUILTIN``."""

__all__ = [
    "base",
    "counters",
    "factory",
    "options",
    "parts",
    "promotion",
    "ram",
    "registry",
    "shared",
    "ssd",
    "stack",
    "write_behind",
]
