"""The RAM tier: the prefix tree under a byte budget."""
