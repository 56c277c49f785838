"""Tiers: the protocols by role (``base``), the stack that holds them (``stack``), their shared
parts (``write_behind``, ``counters``, ``parts``), the factory, and one package per tier
(``ram``, ``ssd``, ``shared``). A new tier implements ``base.LowerTier`` (usually a ``PartsTier``
of a reader, a writer and a sessions part over ``write_behind``) and registers a name."""

__all__ = [
    "base",
    "counters",
    "factory",
    "parts",
    "promotion",
    "ram",
    "shared",
    "ssd",
    "stack",
    "write_behind",
]
