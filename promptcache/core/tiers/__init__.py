"""Tiers: the protocols, the stack, the write-behind queue, and each tier's package."""
