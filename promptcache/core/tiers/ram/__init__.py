"""The RAM tier: the prefix tree under a byte budget (``tier.RamTier``) and its sessions half."""

__all__ = ["tier"]
